// pyspy_clock.bpf.c -- kernel timestamps for py-spy's recorder clock.
//
// What: a uprobe on py-spy's `<Chrometrace as Recorder>::increment`. py-spy
// calls it once per thread per sample and stamps the chrometrace events it
// writes with `Instant::now()` (CLOCK_MONOTONIC) relative to its start; each
// hit here is the same instant in bpf_ktime_get_ns() terms.  The first hit of
// a py-spy process pins its clock offset; bursts of hits are its samples.
// flamed/python/align.py turns them into a calibration (see docs/mixed-mode.md).
//
// Why a uprobe and not sys_enter_process_vm_readv: the uprobe only fires in
// py-spy processes; a syscall tracepoint runs for every syscall on the host.
//
// Loaded by bcc (flamed/python/clock.py), separately from the main sampler.
// Configured by defines: RINGBUF_PAGES (power of two).

#include <uapi/linux/ptrace.h>

#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 64
#endif

struct pyspy_hit {
    u64 ktime_ns;
    u32 tgid;
    u32 tid;
};

BPF_RINGBUF_OUTPUT(pyspy_hits, RINGBUF_PAGES);
// [0] hits submitted, [1] hits dropped (ring buffer full)
BPF_ARRAY(pyspy_clock_stats, u64, 2);

int on_increment(struct pt_regs *ctx)
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
    h->tid = (u32)id;
    pyspy_hits.ringbuf_submit(h, 0);
    u64 *c = pyspy_clock_stats.lookup(&idx);
    if (c)
        __sync_fetch_and_add(c, 1);
    return 0;
}
