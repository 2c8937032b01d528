/* flamed.h -- the structs and indices shared by bpf/profile.bpf.c and
 * flamed/bpfsampler.py.  Python mirrors the structs with ctypes and reads the
 * FLAMED_STAT_* values out of this file, so this header is the one place that
 * defines them.
 *
 * Only fixed-width UAPI types: the layout must not depend on which kernel
 * headers bcc compiles against.
 */
#ifndef FLAMED_H
#define FLAMED_H

#define FLAMED_COMM_LEN 16

/* Key of the count maps: one entry per (task, stack pair). */
struct flamed_key {
    __u32 tgid;
    __u32 tid;
    /* >= 0: id in the generation's stack map.  < 0: -errno of
     * bpf_get_stackid; -EFAULT: no frames, as expected (kernel side of a
     * user-mode sample, user side of a kernel thread); -ENODATA: no frames
     * where there must be some (counted as *_STACK_MISSING). */
    __s32 kernel_stack_id;
    __s32 user_stack_id;
    char comm[FLAMED_COMM_LEN];
};

/* One sample of a watched process, sent through the ring buffer. */
struct flamed_event {
    __u64 ktime_ns; /* bpf_ktime_get_ns(): CLOCK_MONOTONIC */
    __u32 tgid;
    __u32 tid;
    __u32 cpu;
    __u32 gen; /* generation whose stack map holds the stack ids */
    __s32 kernel_stack_id;
    __s32 user_stack_id;
    char comm[FLAMED_COMM_LEN];
};

/* A process image as the program can tell it without reading kernel
 * structs: an exec keeps the tgid but nearly always changes the comm. */
struct flamed_task {
    __u32 tgid;
    char comm[FLAMED_COMM_LEN];
};

/* Key of the comm filter map. */
struct flamed_comm {
    char comm[FLAMED_COMM_LEN];
};

/* Per-CPU counters.  The stats array holds three blocks of FLAMED_NSTATS
 * slots: generation 0, generation 1 (both drained with their generation, so a
 * window's counters match its counts exactly) and a block for what happens
 * outside any window (FLAMED_STATS_GLOBAL: IDLE, FILTERED, and SAMPLES
 * again, counted before the generation is chosen and never reset, so the
 * windows can be checked to add up to it).  Keep the "= N" form: Python
 * parses these lines. */
enum flamed_stat {
    FLAMED_STAT_SAMPLES = 0,        /* samples that passed the filters */
    FLAMED_STAT_COUNTED = 1,        /* ... added to the count map */
    FLAMED_STAT_EVENTS = 2,         /* ... sent to the ring buffer */
    FLAMED_STAT_MAP_FULL = 3,       /* dropped: count map full */
    FLAMED_STAT_RINGBUF_FULL = 4,   /* watched, ring buffer full: counted instead */
    FLAMED_STAT_KSTACK_EEXIST = 5,  /* kernel stack id: bucket collision */
    FLAMED_STAT_KSTACK_ENOMEM = 6,  /* kernel stack id: no free stack entry */
    FLAMED_STAT_KSTACK_ERROR = 7,   /* kernel stack id: other errno */
    FLAMED_STAT_USTACK_EEXIST = 8,
    FLAMED_STAT_USTACK_ENOMEM = 9,
    FLAMED_STAT_USTACK_ERROR = 10,
    FLAMED_STAT_KSTACK_MISSING = 11, /* in kernel mode, but no kernel frame */
    FLAMED_STAT_USTACK_MISSING = 12, /* in user mode, but no user frame */
    FLAMED_STAT_IDLE = 13,          /* global block only: idle samples skipped */
    FLAMED_STAT_FILTERED = 14,      /* global block only: filtered out */
    FLAMED_NSTATS = 15,
};

#define FLAMED_STATS_GLOBAL 2
#define FLAMED_STATS_SLOTS (3 * FLAMED_NSTATS)

#endif /* FLAMED_H */
