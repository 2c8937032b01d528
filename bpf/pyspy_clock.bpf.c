// pyspy_clock.bpf.c -- kernel timestamps for py-spy's recorder clock.
//
// What: a uprobe on py-spy's `<Chrometrace as Recorder>::increment`. py-spy
// calls it once per thread per sample and stamps the chrometrace events it
// writes with `Instant::now()` (CLOCK_MONOTONIC) relative to its start; each
// hit here is the same instant in bpf_ktime_get_ns() terms.  The first hit of
// a py-spy process bounds its clock offset; bursts of hits are its samples.
// flamed/pyspy/clockfit.py turns them into a calibration (see docs/mixed-mode.md).
//
// The increment runs after py-spy has read the stacks, late by 0.2-5 ms on a
// busy host (measured).  With TRACE_VM_READV, a tracepoint on
// sys_enter_process_vm_readv, filtered to the py-spy pids user space puts in
// `pyspy_pids`, also reports when each sample's reads began.  It runs for
// every syscall on the host (a map lookup, tens of ns), so it is optional.
//
// Loaded by bcc (flamed/pyspy/clock.py), separately from the main sampler.
// Configured by defines: RINGBUF_PAGES (power of two), TRACE_VM_READV, MAX_PYSPY, BURST_GAP_NS.

#include <uapi/linux/ptrace.h>

#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 64
#endif

#ifndef MAX_PYSPY
#define MAX_PYSPY 256
#endif

#define HIT_INCREMENT 1
#define HIT_VM_READV 2

struct pyspy_hit {
    u64 ktime_ns;
    u32 tgid;
    u32 kind;
};

BPF_RINGBUF_OUTPUT(pyspy_hits, RINGBUF_PAGES);
// [0] hits submitted, [1] hits dropped (ring buffer full)
BPF_ARRAY(pyspy_clock_stats, u64, 2);

static __always_inline int emit(u32 kind)
{
    u64 now = bpf_ktime_get_ns();
    u64 id = bpf_get_current_pid_tgid();
    int idx = 0;
    struct pyspy_hit *h = pyspy_hits.ringbuf_reserve(sizeof(struct pyspy_hit));
    if (!h) {
        idx = 1;
        u64 *c = pyspy_clock_stats.lookup(&idx);
        if (c)
            __sync_fetch_and_add(c, 1);
        return 0;
    }
    h->ktime_ns = now;
    h->tgid = id >> 32;
    h->kind = kind;
    pyspy_hits.ringbuf_submit(h, 0);
    u64 *c = pyspy_clock_stats.lookup(&idx);
    if (c)
        __sync_fetch_and_add(c, 1);
    return 0;
}

int on_increment(struct pt_regs *ctx)
{
    return emit(HIT_INCREMENT);
}

#ifdef TRACE_VM_READV
#ifndef BURST_GAP_NS
#define BURST_GAP_NS 1000000
#endif
// py-spy pid -> time of its last process_vm_readv.  A sample is a burst of
// dozens of reads; only a read that follows a quiet BURST_GAP_NS (the first
// of a burst) is sent, so user space gets one record per sample.
BPF_HASH(pyspy_pids, u32, u64, MAX_PYSPY);

TRACEPOINT_PROBE(syscalls, sys_enter_process_vm_readv)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u64 *last = pyspy_pids.lookup(&tgid);
    if (!last)
        return 0;
    u64 now = bpf_ktime_get_ns();
    u64 prev = *last;
    *last = now;
    if (prev && now - prev < BURST_GAP_NS)
        return 0;
    return emit(HIT_VM_READV);
}
#endif
