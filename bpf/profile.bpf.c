/* profile.bpf.c -- flamed's stack sampler, loaded by bcc from this file.
 *
 * What: on every perf event (CPU cycles, or the software cpu-clock where the
 * hardware event is missing) on every CPU, take the kernel and user stack ids
 * of the interrupted task and count {tgid, tid, comm, kernel stack, user stack}
 * in a hash map.  For processes in `watched` (Python processes in mixed mode)
 * send a timestamped event through a ring buffer instead, so user space can
 * join it with Python frames by time.
 *
 * Why in the kernel: only unique stacks and their counts cross to user space.
 *
 * Generations: the count maps and the stack maps exist twice.  `generation`
 * says which pair the program writes.  A drain flips it, waits until no
 * program still runs on the old pair (the per-CPU `inflight` sequence is odd
 * while a program runs), then reads and clears the old pair at leisure.
 * Samples are never lost or counted twice across a drain, and stack ids stay
 * valid until the counts that reference them have been read.
 *
 * Every way a sample can degrade is counted per CPU and per generation in
 * `stats` (indices in flamed.h).
 *
 * Header safety: only UAPI types, the perf-event context and helpers.  No
 * kernel struct is read, so compiling against headers of another kernel
 * version cannot change what the program means.
 *
 * Configured by -D defines only (flamed/sampling/bpf.py passes them; `flamed
 * daemon --print-bpf` shows them):
 *   FLAMED_STACK_ENTRIES  stack ids per generation (default 16384)
 *   FLAMED_STACK_DEPTH    frames kept per stack, <= 127 (default 127)
 *   FLAMED_MAX_ENTRIES    count map entries per generation (default 65536)
 *   FLAMED_RINGBUF_PAGES  ring buffer size in pages, a power of 2 (default 256)
 *   FLAMED_MAX_WATCHED    watched processes (default 1024)
 *   FLAMED_TIMELINE       1: also send every counted sample's time and stack
 *                         ids through the ring buffer (record --timeline)
 *   FLAMED_FILTER_MAX     entries of each filter map (default 1024)
 *   FLAMED_INCLUDE_IDLE   1: also sample the idle task (pid 0)
 *   FLAMED_PRIME          1: report each process image the first time it is
 *                         sampled (see `new_images` below)
 *   FLAMED_SEEN_MAX       process images remembered for that (LRU, default 16384)
 *   FLAMED_TASK_EXEC_ID_OFF  offset of self_exec_id in task_struct (from the
 *                         kernel's BTF), or -1: with it an exec is a new image
 *                         even when the comm stays the same
 *   FLAMED_PYTHON         1: walk the Python frames of the processes in
 *                         `pyprocs` (python.bpf.c, its own defines there)
 *   FLAMED_UNWIND         1: unwind the user stacks of the processes in
 *                         `uw_procs` from their .eh_frame tables
 *                         (unwind.bpf.c, its own defines there)
 *   FLAMED_FILTER_PIDS, FLAMED_FILTER_TIDS, FLAMED_FILTER_CGROUPS,
 *   FLAMED_FILTER_COMMS   1: sample only tasks found in that filter map
 *   FLAMED_FOLLOW_FORKS   1 (with FLAMED_FILTER_PIDS): a process that a
 *                         filtered one starts is filtered in at its fork
 *                         (flamed_forked, flamed_exited below)
 *   FLAMED_TASK_PID_OFF   offset of pid in task_struct (from the kernel's
 *                         BTF): with FLAMED_FOLLOW_FORKS or FLAMED_OFFCPU
 */
#include <uapi/linux/ptrace.h>

/* The perf-event context, as UAPI fixes it (linux/bpf_perf_event.h; on x86-64
 * bpf_user_pt_regs_t is struct pt_regs).  Declared here rather than included:
 * that header pulls in the kernel's asm/ptrace.h tree, and parsing it was
 * 0.9 s of every compile (docs/bpf.md, "Start-up"). */
struct bpf_perf_event_data {
    struct pt_regs regs;
    __u64 sample_period;
    __u64 addr;
};

#include "flamed.h"

#ifndef FLAMED_STACK_ENTRIES
#define FLAMED_STACK_ENTRIES 16384
#endif
#ifndef FLAMED_STACK_DEPTH
#define FLAMED_STACK_DEPTH 127
#endif
#ifndef FLAMED_MAX_ENTRIES
#define FLAMED_MAX_ENTRIES 65536
#endif
#ifndef FLAMED_RINGBUF_PAGES
#define FLAMED_RINGBUF_PAGES 256
#endif
#ifndef FLAMED_MAX_WATCHED
#define FLAMED_MAX_WATCHED 1024
#endif
#ifndef FLAMED_TIMELINE
#define FLAMED_TIMELINE 0
#endif
#ifndef FLAMED_FILTER_MAX
#define FLAMED_FILTER_MAX 1024
#endif
#ifndef FLAMED_INCLUDE_IDLE
#define FLAMED_INCLUDE_IDLE 0
#endif
#ifndef FLAMED_PRIME
#define FLAMED_PRIME 0
#endif
#ifndef FLAMED_SEEN_MAX
#define FLAMED_SEEN_MAX 16384
#endif
#ifndef FLAMED_FILTER_PIDS
#define FLAMED_FILTER_PIDS 0
#endif
#ifndef FLAMED_FILTER_TIDS
#define FLAMED_FILTER_TIDS 0
#endif
#ifndef FLAMED_FILTER_CGROUPS
#define FLAMED_FILTER_CGROUPS 0
#endif
#ifndef FLAMED_FILTER_COMMS
#define FLAMED_FILTER_COMMS 0
#endif

#define FLAMED_EFAULT 14
#define FLAMED_ENOMEM 12
#define FLAMED_EEXIST 17
#define FLAMED_ENODATA 61

#ifndef FLAMED_PYTHON
#define FLAMED_PYTHON 0
#endif
#ifndef FLAMED_UNWIND
#define FLAMED_UNWIND 0
#endif

/* A stack map value: FLAMED_STACK_DEPTH instruction pointers, leaf first,
 * zero-terminated when shorter.  Fewer than 127 frames make each entry (and
 * the preallocated map) smaller. */
struct flamed_stack {
    __u64 ip[FLAMED_STACK_DEPTH];
};

BPF_ARRAY(generation, u32, 1);
BPF_PERCPU_ARRAY(inflight, u64, 1);
BPF_PERCPU_ARRAY(stats, u64, FLAMED_STATS_SLOTS);

BPF_HASH(counts0, struct flamed_key, u64, FLAMED_MAX_ENTRIES);
BPF_HASH(counts1, struct flamed_key, u64, FLAMED_MAX_ENTRIES);
/* No BPF_F_REUSE_STACKID: reusing a bucket would silently rename the stack
 * behind ids already counted.  A collision returns -EEXIST, which is counted
 * and shown as a placeholder frame. */
BPF_TABLE("stacktrace", int, struct flamed_stack, stacks0, FLAMED_STACK_ENTRIES);
BPF_TABLE("stacktrace", int, struct flamed_stack, stacks1, FLAMED_STACK_ENTRIES);

BPF_HASH(watched, u32, u8, FLAMED_MAX_WATCHED);
/* How many processes `watched` holds (user space writes it after each change
 * of the map): while there are none, which is most of the time, a sample
 * does not look for its process there.  A hash lookup that misses is a
 * cache miss or two at every sample (~100 ns here, bench/bpf_floor.py); this
 * one array slot is read by every CPU and written rarely. */
BPF_ARRAY(watched_count, u32, 1);
BPF_HASH(filter_pids, u32, u8, FLAMED_FILTER_MAX);
BPF_HASH(filter_tids, u32, u8, FLAMED_FILTER_MAX);
BPF_HASH(filter_cgroups, u64, u8, FLAMED_FILTER_MAX);
BPF_HASH(filter_comms, struct flamed_comm, u8, FLAMED_FILTER_MAX);

#ifndef FLAMED_FOLLOW_FORKS
#define FLAMED_FOLLOW_FORKS 0
#endif
#if FLAMED_FOLLOW_FORKS && FLAMED_FILTER_PIDS
/* What a filtered process starts is filtered in here, from its first
 * instruction (`flamed record --subprocesses`): user space learns of a new
 * process from the proc connector or a /proc scan, milliseconds to a second
 * later, and a child that blocks at once would lose that first wait whole.
 * Entries made here hold FLAMED_FOLLOWED; user space writes 1. */
#define FLAMED_FOLLOWED 2
#define FLAMED_CLONE_THREAD 0x00010000ULL
/* Processes whose new children are filtered in, themselves not sampled:
 * `flamed record` while it starts the command, so that the command is in the
 * filter from its fork, before it can start anything of its own. */
BPF_HASH(fork_parents, u32, u8, 64);

/* task_newtask(struct task_struct *task, u64 clone_flags), in the parent,
 * once the child has its pid.  A new thread is not a new process. */
int flamed_forked(struct bpf_raw_tracepoint_args *ctx)
{
    if ((u64)ctx->args[1] & FLAMED_CLONE_THREAD)
        return 0;
    u32 parent = bpf_get_current_pid_tgid() >> 32;
    if (!filter_pids.lookup(&parent) && !fork_parents.lookup(&parent))
        return 0;
    u32 child = 0;
    bpf_probe_read_kernel(&child, sizeof(child), (void *)ctx->args[0] + FLAMED_TASK_PID_OFF);
    u8 followed = FLAMED_FOLLOWED;
    if (child)
        filter_pids.insert(&child, &followed); /* full: the child is found later, as without this */
    return 0;
}

/* sched_process_exit(struct task_struct *p, ...), in the exiting task: a
 * process filtered in at its fork leaves the filter with its main thread
 * (its pid may be reused by anything); those user space added, it removes. */
int flamed_exited(struct bpf_raw_tracepoint_args *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if ((u32)id != tgid)
        return 0;
    u8 *v = filter_pids.lookup(&tgid);
    if (v && *v == FLAMED_FOLLOWED)
        filter_pids.delete(&tgid);
    return 0;
}
#endif

BPF_RINGBUF_OUTPUT(events, FLAMED_RINGBUF_PAGES);

/* Symbolizing user stacks needs /proc/PID/maps, and a process that exits
 * before the next drain takes its maps with it.  So the first sample of each
 * process image (tgid + comm + exec count) is reported through `new_images` at once, and
 * user space reads the maps while the process still runs; `seen` (LRU) keeps
 * the images already reported. */
#if FLAMED_PRIME
BPF_TABLE("lru_hash", struct flamed_task, u8, seen, FLAMED_SEEN_MAX);
BPF_PERF_OUTPUT(new_images);
/* The image this CPU's last sample was of: consecutive samples of a CPU are
 * nearly always of the same process, and comparing 20 bytes here costs less
 * than the LRU lookup it saves.  (A hit does not refresh the image's LRU
 * entry: if `seen` evicts it meanwhile, the image is reported once more,
 * which user space takes as a repeat.) */
BPF_PERCPU_ARRAY(last_image, struct flamed_task, 1);

#ifndef FLAMED_TASK_EXEC_ID_OFF
#define FLAMED_TASK_EXEC_ID_OFF -1
#endif

static __always_inline void report_new_image(struct bpf_perf_event_data *ctx, struct flamed_key *key)
{
    struct flamed_task t = {};
    t.tgid = key->tgid;
    __builtin_memcpy(t.comm, key->comm, FLAMED_COMM_LEN);
#if FLAMED_TASK_EXEC_ID_OFF >= 0
    /* The process's exec count (self_exec_id is per task; every thread of an
     * image has the leader's, as exec leaves one thread). */
    bpf_probe_read_kernel(&t.exec_id, sizeof(t.exec_id),
                          (void *)bpf_get_current_task() + FLAMED_TASK_EXEC_ID_OFF);
#endif
    u32 zero = 0;
    struct flamed_task *last = last_image.lookup(&zero);
    if (last && last->tgid == t.tgid && last->exec_id == t.exec_id) {
        u64 a0, a1, b0, b1;
        __builtin_memcpy(&a0, last->comm, 8);
        __builtin_memcpy(&a1, last->comm + 8, 8);
        __builtin_memcpy(&b0, t.comm, 8);
        __builtin_memcpy(&b1, t.comm + 8, 8);
        if (a0 == b0 && a1 == b1)
            return;
    }
    if (last)
        __builtin_memcpy(last, &t, sizeof(t));
    if (seen.lookup(&t))
        return;
    u8 one = 1;
    seen.update(&t, &one);
    /* Not delivered (the buffer full, counted by user space as lost, or
     * busy with a nested output on this CPU, counted nowhere): the image is
     * unmarked, so that the process's next sample reports it again.  Marked
     * for good, a short process was never read while it ran: no Python frames
     * and no unwinding for its whole life.  (The drain still reads the maps
     * of whatever is alive then.) */
    if (new_images.perf_submit(ctx, &t, sizeof(t)) != 0) {
        seen.delete(&t);
        if (last)
            last->tgid = 0;
    }
}
#endif

#if FLAMED_PRIME
/* Code mapped after a process was read (dlopen: an extension module and what
 * it links) is reported through `new_code`, so that user space reads the
 * maps again while the process runs: one that exits before the drain still
 * has those frames named.  The raw tracepoint mmap_lock_released fires as
 * mmap(2) lets go of the memory map, the new mapping in place; the program
 * reports it when that mmap maps a file with PROT_EXEC (the dynamic loader
 * maps each library's text so), from the syscall's own registers.  Only
 * processes user space has read (`read_tgids`, written by it) are looked at:
 * every program that starts maps its libraries before its first read. */
/* x86-64's mmap(2), and PROT_EXEC. */
#define FLAMED_NR_MMAP 9
#define FLAMED_PROT_EXEC 4
BPF_TABLE("lru_hash", u32, u8, read_tgids, FLAMED_SEEN_MAX);
BPF_PERF_OUTPUT(new_code);

int flamed_code_mapped(struct bpf_raw_tracepoint_args *ctx)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!read_tgids.lookup(&tgid))
        return 0;
    struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(bpf_get_current_task_btf());
    u64 nr = 0, prot = 0, fd = 0;
    if (bpf_probe_read_kernel(&nr, sizeof(nr), &regs->orig_ax) ||
        bpf_probe_read_kernel(&prot, sizeof(prot), &regs->dx) ||
        bpf_probe_read_kernel(&fd, sizeof(fd), &regs->r8))
        return 0;
    if (nr != FLAMED_NR_MMAP || !(prot & FLAMED_PROT_EXEC) || (int)fd < 0)
        return 0;
    new_code.perf_submit(ctx, &tgid, sizeof(tgid));
    return 0;
}
#endif

/* The 64-bit hash that names a stack built by the program (Python frames,
 * unwound user stacks) in its per-generation map. */
static __always_inline u64 flamed_mix(u64 h, u64 v)
{
    h ^= v;
    h *= 0x100000001b3ULL;
    h ^= h >> 29;
    return h;
}

static __always_inline void stat_inc(u32 block, u32 which)
{
    u32 idx = block * FLAMED_NSTATS + which;
    u64 *v = stats.lookup(&idx);
    if (v)
        (*v)++;
}

#if FLAMED_PYTHON
/* In bpf/python.bpf.c, which the loader appends to this file: bcc rewrites
 * map calls only in the text it is given, not in included files. */
static __always_inline u64 py_take_timed(struct bpf_perf_event_data *ctx, u32 gen, u32 tgid, u32 tid, int guard);
static __always_inline void py_guard_end(struct bpf_perf_event_data *ctx);
#endif
#if FLAMED_UNWIND
/* In bpf/unwind.bpf.c, appended like python.bpf.c. */
static __always_inline void uw_begin(struct bpf_perf_event_data *ctx, u32 gen, struct flamed_key *key,
                                     int is_watched);
#endif

/* Is the process in `watched`? */
static __always_inline int is_watched_tgid(u32 tgid)
{
    u32 zero = 0;
    u32 *n = watched_count.lookup(&zero);
    return n && *n && watched.lookup(&tgid) != NULL;
}

/* Was the task interrupted in user mode?  Tells a missing stack (an error)
 * from an absent one (no kernel frames while in user mode, no user frames
 * for a kernel thread). */
static __always_inline int in_user_mode(struct bpf_perf_event_data *ctx)
{
#if defined(__x86_64__)
    return (ctx->regs.cs & 3) != 0;
#else
    /* Kernel text lives in the upper half on the 64-bit architectures. */
    return (s64)PT_REGS_IP(&ctx->regs) >= 0;
#endif
}

/* Count what went wrong with the stack ids.  -EFAULT means "no frames": for
 * the kernel stack of a task interrupted in user mode, or the user stack of a
 * kernel thread, that is expected.  Where a stack must exist (the side the
 * task was interrupted on) and is empty, the id becomes -ENODATA, so user
 * space shows a "[missing ... stack]" placeholder for exactly those. */
static __always_inline void stack_errors(u32 block, int user_mode, s32 *kidp, s32 *uidp)
{
    s32 kid = *kidp;
    s32 uid = *uidp;
    if (kid < 0) {
        if (kid == -FLAMED_EEXIST)
            stat_inc(block, FLAMED_STAT_KSTACK_EEXIST);
        else if (kid == -FLAMED_ENOMEM)
            stat_inc(block, FLAMED_STAT_KSTACK_ENOMEM);
        else if (kid != -FLAMED_EFAULT)
            stat_inc(block, FLAMED_STAT_KSTACK_ERROR);
        else if (!user_mode) {
            stat_inc(block, FLAMED_STAT_KSTACK_MISSING);
            *kidp = -FLAMED_ENODATA;
        }
    }
    if (uid < 0) {
        if (uid == -FLAMED_EEXIST)
            stat_inc(block, FLAMED_STAT_USTACK_EEXIST);
        else if (uid == -FLAMED_ENOMEM)
            stat_inc(block, FLAMED_STAT_USTACK_ENOMEM);
        else if (uid != -FLAMED_EFAULT)
            stat_inc(block, FLAMED_STAT_USTACK_ERROR);
        else if (user_mode) {
            stat_inc(block, FLAMED_STAT_USTACK_MISSING);
            *uidp = -FLAMED_ENODATA;
        }
    }
}

/* Send a sample to user space with its time: a watched task's (instead of
 * counting it), or, with `timeline`, a copy of a counted one; 0 on success. */
static __always_inline int emit_event(u32 gen, struct flamed_key *key, u32 timeline)
{
    struct flamed_event *e = events.ringbuf_reserve(sizeof(struct flamed_event));
    if (!e)
        return -1;
    e->ktime_ns = bpf_ktime_get_ns();
    e->tgid = key->tgid;
    e->tid = key->tid;
    e->cpu = bpf_get_smp_processor_id();
    e->gen = gen;
    e->kernel_stack_id = key->kernel_stack_id;
    e->user_stack_id = key->user_stack_id;
    __builtin_memcpy(e->comm, key->comm, FLAMED_COMM_LEN);
    e->native_stack_id = key->native_stack_id;
    e->native_leaf = key->native_leaf;
    e->py_stack_id = key->py_stack_id;
    e->timeline = timeline;
    e->pad = 0;
    events.ringbuf_submit(e, 0);
    return 0;
}

/* The two generations differ only in the maps they name; bcc resolves map
 * names at compile time, so the body is spelled out once per generation. */
static __always_inline void take_gen0(struct bpf_perf_event_data *ctx, struct flamed_key *key, int is_watched)
{
    /* Interrupted in user mode, the kernel side has no frames: the helper
     * would walk nothing and return -EFAULT, after taking a callchain buffer. */
    int user_mode = in_user_mode(ctx);
    key->kernel_stack_id = user_mode ? -FLAMED_EFAULT : stacks0.get_stackid(ctx, 0);
    /* A process with unwind tables has its user stack already
     * (bpf/unwind.bpf.c): the frame-pointer walk is not taken. */
    if (!key->native_stack_id)
        key->user_stack_id = stacks0.get_stackid(ctx, BPF_F_USER_STACK);
    s32 unwound = 0; /* stands in for the user stack id when the tables gave the stack */
    stack_errors(0, user_mode, &key->kernel_stack_id, key->native_stack_id ? &unwound : &key->user_stack_id);
    if (is_watched) {
        if (emit_event(0, key, 0) == 0) {
            stat_inc(0, FLAMED_STAT_EVENTS);
            return;
        }
        stat_inc(0, FLAMED_STAT_RINGBUF_FULL);
    }
    u64 *v = counts0.lookup(key);
    if (!v) {
        u64 one = 1;
        if (counts0.insert(key, &one) == 0) {
            stat_inc(0, FLAMED_STAT_COUNTED);
            return;
        }
        /* Another CPU may have inserted the same key meanwhile. */
        v = counts0.lookup(key);
        if (!v) {
            stat_inc(0, FLAMED_STAT_MAP_FULL);
            return;
        }
    }
    __sync_fetch_and_add(v, 1);
    stat_inc(0, FLAMED_STAT_COUNTED);
}

static __always_inline void take_gen1(struct bpf_perf_event_data *ctx, struct flamed_key *key, int is_watched)
{
    /* Interrupted in user mode, the kernel side has no frames: the helper
     * would walk nothing and return -EFAULT, after taking a callchain buffer. */
    int user_mode = in_user_mode(ctx);
    key->kernel_stack_id = user_mode ? -FLAMED_EFAULT : stacks1.get_stackid(ctx, 0);
    /* A process with unwind tables has its user stack already
     * (bpf/unwind.bpf.c): the frame-pointer walk is not taken. */
    if (!key->native_stack_id)
        key->user_stack_id = stacks1.get_stackid(ctx, BPF_F_USER_STACK);
    s32 unwound = 0; /* stands in for the user stack id when the tables gave the stack */
    stack_errors(1, user_mode, &key->kernel_stack_id, key->native_stack_id ? &unwound : &key->user_stack_id);
    if (is_watched) {
        if (emit_event(1, key, 0) == 0) {
            stat_inc(1, FLAMED_STAT_EVENTS);
            return;
        }
        stat_inc(1, FLAMED_STAT_RINGBUF_FULL);
    }
    u64 *v = counts1.lookup(key);
    if (!v) {
        u64 one = 1;
        if (counts1.insert(key, &one) == 0) {
            stat_inc(1, FLAMED_STAT_COUNTED);
            return;
        }
        v = counts1.lookup(key);
        if (!v) {
            stat_inc(1, FLAMED_STAT_MAP_FULL);
            return;
        }
    }
    __sync_fetch_and_add(v, 1);
    stat_inc(1, FLAMED_STAT_COUNTED);
}

/* The end of every sample: count it in its generation, then close the
 * in-flight section flamed_sample opened (see the header comment). */
static __always_inline void finish_sample(struct bpf_perf_event_data *ctx, struct flamed_key *key, u32 gen,
                                          int is_watched)
{
#if FLAMED_PYTHON
    /* Once here, not in each generation's body: the walker is the largest
     * part of the program, and every copy is compiled and verified. */
    if (!is_watched)
        key->py_stack_id = py_take_timed(ctx, gen, key->tgid, key->tid, 1);
#endif
    if (gen)
        take_gen1(ctx, key, is_watched);
    else
        take_gen0(ctx, key, is_watched);
#if FLAMED_TIMELINE
    /* Each counted sample's time too (`flamed record --timeline`): a copy
     * through the ring buffer, after the stack ids are in the key.  One that
     * finds the buffer full is missing from the timeline only (user space
     * counts those by difference with the samples counted). */
    if (!is_watched)
        emit_event(gen, key, 1);
#endif
#if FLAMED_PYTHON
    /* A new Python stack's guards: flamed_pyguard ends the sample (returns
     * here only when there was nothing to do, or the tail call failed). */
    if (!is_watched)
        py_guard_end(ctx);
#endif
    u32 zero = 0;
    u64 *seq = inflight.lookup(&zero);
    if (seq)
        __sync_fetch_and_add(seq, 1);
}

/* 1 when the task passes every enabled filter. */
static __always_inline int wanted(struct flamed_key *key)
{
#if FLAMED_FILTER_PIDS
    if (!filter_pids.lookup(&key->tgid))
        return 0;
#endif
#if FLAMED_FILTER_TIDS
    if (!filter_tids.lookup(&key->tid))
        return 0;
#endif
#if FLAMED_FILTER_CGROUPS
    u64 cg = bpf_get_current_cgroup_id();
    if (!filter_cgroups.lookup(&cg))
        return 0;
#endif
#if FLAMED_FILTER_COMMS
    struct flamed_comm c = {};
    __builtin_memcpy(c.comm, key->comm, FLAMED_COMM_LEN);
    if (!filter_comms.lookup(&c))
        return 0;
#endif
    return 1;
}

int flamed_sample(struct bpf_perf_event_data *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u32 tid = (u32)id;

#if !FLAMED_INCLUDE_IDLE
    if (tid == 0) {
        stat_inc(FLAMED_STATS_GLOBAL, FLAMED_STAT_IDLE);
        return 0;
    }
#endif

    struct flamed_key key = {};
    key.tgid = tgid;
    key.tid = tid;
    bpf_get_current_comm(&key.comm, sizeof(key.comm));
    key.cgroup_id = bpf_get_current_cgroup_id();

    /* A watched process is sampled whatever the filters say: watching is an
     * explicit request for that process. */
    int is_watched = is_watched_tgid(tgid);
    if (!is_watched && !wanted(&key)) {
        stat_inc(FLAMED_STATS_GLOBAL, FLAMED_STAT_FILTERED);
        return 0;
    }

    /* Never reset: lets a test check that the windows add up to it. */
    stat_inc(FLAMED_STATS_GLOBAL, FLAMED_STAT_SAMPLES);

#if FLAMED_PRIME
    if (tgid != 0)
        report_new_image(ctx, &key);
#endif

    u32 zero = 0;
    u64 *seq = inflight.lookup(&zero);
    if (!seq)
        return 0;
    /* Odd while this program uses a generation.  The atomic add is a full
     * barrier, so the generation is read only after the odd value is
     * visible to a draining reader. */
    __sync_fetch_and_add(seq, 1);
    u32 *genp = generation.lookup(&zero);
    u32 gen = genp ? (*genp & 1) : 0;
    stat_inc(gen, FLAMED_STAT_SAMPLES);
#if FLAMED_UNWIND
    /* A process with unwind tables continues in flamed_unwind and ends in
     * flamed_finish (bpf/unwind.bpf.c): uw_begin returns only otherwise. */
    uw_begin(ctx, gen, &key, is_watched);
#endif
    finish_sample(ctx, &key, gen, is_watched);
    return 0;
}
