/* flamed.h -- the structs and indices shared by bpf/profile.bpf.c and
 * flamed/sampling/bpf.py.  Python mirrors the structs with ctypes and reads the
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
    /* Id of the Python stack in the generation's pystacks map (a hash of its
     * frames), 0 for none: not a CPython process the program walks, or the
     * walk found nothing (counted as FLAMED_STAT_PY_*). */
    __u64 py_stack_id;
    /* Id of the user stack in the generation's ustacks map (a hash of its
     * callers' addresses), 0 for none: the process has no unwind tables and
     * user_stack_id holds its frame-pointer stack (bpf/unwind.bpf.c). */
    __u64 native_stack_id;
    /* bpf_get_current_cgroup_id(): the task's cgroup v2 id (the inode number
     * of its directory), which user space maps to a service or container;
     * in the key because a process can move between cgroups mid-window. */
    __u64 cgroup_id;
    /* The leaf address of the unwound stack (with native_stack_id): kept out
     * of the stored stack, whose entry holds 0 in its place, so that samples
     * differing only where the CPU was inside a function share one stored
     * stack.  Storing a new 0.5 KiB stack for nearly every sample of an
     * interpreter (its leaf is anywhere in the evaluation loop) was the
     * largest single cost of such a sample. */
    __u64 native_leaf;
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
    __u64 native_stack_id; /* as in struct flamed_key */
    __u64 native_leaf;     /* as in struct flamed_key */
    __u64 py_stack_id;     /* as in struct flamed_key (0 in a watched task's event) */
    /* 0: a watched task's sample, sent instead of counted.  1: a copy of a
     * sample also counted, sent only for its time (FLAMED_TIMELINE: `flamed
     * record --timeline`), which user space must not count again. */
    __u32 timeline;
    __u32 pad;
};

/* A process image as the program can tell it without reading kernel
 * structs: an exec keeps the tgid but nearly always changes the comm. */
struct flamed_task {
    __u32 tgid;
    char comm[FLAMED_COMM_LEN];
    /* The low half of task_struct.self_exec_id, which each exec advances: an
     * image that exec replaced keeps its tgid, and often its comm (a program
     * that execs itself).  0 when the offset is unknown. */
    __u32 exec_id;
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
    FLAMED_STAT_PY_SAMPLES = 15,    /* samples of a described CPython process */
    FLAMED_STAT_PY_STACKS = 16,     /* ... with a Python stack in the key */
    FLAMED_STAT_PY_NO_THREAD = 17,  /* ... whose thread state was not found (a native thread, or not reached yet) */
    FLAMED_STAT_PY_NO_FRAME = 18,   /* ... whose thread state has no frame (idle, or not started) */
    FLAMED_STAT_PY_READ_FAULT = 19, /* ... a read of the interpreter's memory failed */
    FLAMED_STAT_PY_TRUNCATED = 20,  /* ... deeper than FLAMED_PY_DEPTH: outer frames cut */
    FLAMED_STAT_PY_STACKS_FULL = 21,/* ... the pystacks map was full: no Python frames */
    FLAMED_STAT_PY_NS = 22,         /* ns spent walking Python frames (FLAMED_PY_TIMING=1 only) */
    FLAMED_STAT_UW_SAMPLES = 23,    /* samples of a process with unwind tables (bpf/unwind.bpf.c) */
    FLAMED_STAT_UW_COMPLETE = 24,   /* ... unwound to the outermost frame */
    FLAMED_STAT_UW_NO_TABLE = 25,   /* ... stopped: no table and no frame pointer to follow */
    FLAMED_STAT_UW_UNSUPPORTED = 26,/* ... stopped: a rule the unwinder cannot follow */
    FLAMED_STAT_UW_DEPTH = 27,      /* ... stopped: deeper than FLAMED_UW_DEPTH */
    FLAMED_STAT_UW_READ_FAULT = 28, /* ... stopped: the stack could not be read, or made no progress */
    FLAMED_STAT_UW_STACKS_FULL = 29,/* ... the ustacks map was full: the frame-pointer stack instead */
    FLAMED_STAT_UW_FP_FRAMES = 30,  /* frames found by frame pointer (no table for their address) */
    FLAMED_STAT_UW_NS = 31,         /* ns spent unwinding (FLAMED_UW_TIMING=1 only) */
    FLAMED_STAT_UW_TAIL_FAILED = 32,/* a tail call into the unwinder failed (programs not installed) */
    FLAMED_STAT_OFF_SWITCHES = 33,  /* off-CPU (bpf/offcpu.bpf.c): selected tasks leaving a CPU */
    FLAMED_STAT_OFF_STARTS = 34,    /* ... remembered in offcpu_start */
    FLAMED_STAT_OFF_START_FULL = 35,/* ... not remembered: offcpu_start full (that wait is lost) */
    FLAMED_STAT_OFF_BELOW = 36,     /* waits shorter than the threshold, not counted */
    FLAMED_STAT_OFF_COUNTED = 37,   /* waits added to offcpu_counts */
    FLAMED_STAT_OFF_MAP_FULL = 38,  /* waits lost: offcpu_counts full */
    FLAMED_STAT_OFF_CARRIED = 39,   /* waits that began before the last drain (offcpu_carried) */
    FLAMED_STAT_OFF_CARRY_FULL = 40,/* ... lost: offcpu_carried full */
    FLAMED_STAT_OFF_STALE = 41,     /* waits whose switch-in was not traced: ended at the CPU's last traced switch */
    /* Recorded waits (counted or carried) whose stack taken at switch-out is
     * lost, by the reasons of slots 5-12 for samples (flamed_offcpu_start.lost). */
    FLAMED_STAT_OFF_KSTACK_EEXIST = 42,
    FLAMED_STAT_OFF_KSTACK_ENOMEM = 43,
    FLAMED_STAT_OFF_KSTACK_ERROR = 44,
    FLAMED_STAT_OFF_USTACK_EEXIST = 45,
    FLAMED_STAT_OFF_USTACK_ENOMEM = 46,
    FLAMED_STAT_OFF_USTACK_ERROR = 47,
    FLAMED_STAT_OFF_KSTACK_MISSING = 48,
    FLAMED_STAT_OFF_USTACK_MISSING = 49, /* always 0: a task leaving a CPU is in kernel mode */
    /* Switch-outs whose stack ids failed, whatever became of the wait (most
     * end below the threshold and are never recorded): stack map pressure,
     * not a loss.  One per stack id that failed (kernel or user). */
    FLAMED_STAT_OFF_FETCH_EEXIST = 50,
    FLAMED_STAT_OFF_FETCH_ENOMEM = 51,
    FLAMED_STAT_OFF_FETCH_ERROR = 52,
    FLAMED_NSTATS = 53,
};

#define FLAMED_STATS_GLOBAL 2
#define FLAMED_STATS_SLOTS (3 * FLAMED_NSTATS)


/* ---- Off-CPU time (bpf/offcpu.bpf.c) ---- */

/* flamed_offcpu_start.flags and flamed_offcpu_key.flags */
#define FLAMED_OFF_PREEMPTED 1    /* left the CPU runnable (preempted, yielded); else it blocked */
#define FLAMED_OFF_GIL 2          /* blocked on a futex inside the interpreter's GIL (docs/offcpu.md) */

/* A task that left the CPU: what it was doing then.  Stack ids are in the
 * maps of generation `epoch & 1`, valid only until the drain of `epoch`. */
struct flamed_offcpu_start {
    __u64 ktime_ns;
    __u64 py_stack_id;
    __u64 cgroup_id;
    __u32 epoch;
    __u32 tgid;
    __s32 kernel_stack_id;
    __s32 user_stack_id;
    __u32 flags;
    /* The FLAMED_STAT_OFF_*STACK_* slots of the stacks that failed at the
     * switch-out, kernel | user << 8 (0: none), counted if the wait is
     * recorded. */
    __u32 lost;
    char comm[FLAMED_COMM_LEN];
};

/* Key of offcpu_counts*: the task and stacks of a wait that began and ended
 * in the same generation; the value is nanoseconds. */
struct flamed_offcpu_key {
    struct flamed_key key;
    __u32 flags;
    __u32 pad;
};

/* Key and value of offcpu_carried*: one wait that began in an earlier
 * generation than it ended in, whose stacks user space kept at the drain of
 * the generation it began in. */
struct flamed_offcpu_carry_key {
    __u32 tid;
    __u32 pad;
    __u64 ktime_ns; /* the wait's start: with the tid, names it */
};

struct flamed_offcpu_carry {
    struct flamed_offcpu_start start;
    __u64 ns;
};

/* ---- CPython frames read by the program (bpf/python.bpf.c) ----
 *
 * How the program finds and walks one CPython process's frames.  User space
 * (flamed/sampling/cpython/) fills one per process, keyed by tgid, from the
 * interpreter's layout.  Offsets are in bytes.  The program reads
 * FLAMED_PY_TSTATE_BYTES of a PyThreadState and FLAMED_PY_FRAME_BYTES of a
 * frame in one read each, so every tstate_* / frame_* offset + 8 must fit in
 * those sizes (user space refuses a layout where it does not). */
#define FLAMED_PY_TSTATE_BYTES 256
#define FLAMED_PY_FRAME_BYTES 128
/* At most this many bytes of a code object are read for a frame's guard. */
#define FLAMED_PY_CODE_BYTES 128
#define FLAMED_PY_NONE 0xffff

/* flamed_pyproc.thread_match */
#define FLAMED_PY_MATCH_TID 0     /* tstate field == the task's pid (3.11+ native_thread_id) */
#define FLAMED_PY_MATCH_FSBASE 1  /* tstate field == the thread's fs base (pthread_self(), 3.8-3.10) */

/* flamed_pyproc.flags */
#define FLAMED_PY_CFRAME 1        /* tstate_frame points to a _PyCFrame: frame = *(cframe + cframe_frame) */

struct flamed_pyproc {
    __u64 interp_addr;           /* address of the pointer _PyRuntime.interpreters.main (the main
                                  * interpreter; interpreters.head is the newest one) */
    __u16 version;               /* major << 8 | minor */
    __u8 thread_match;           /* FLAMED_PY_MATCH_* */
    __u8 flags;                  /* FLAMED_PY_* flags */
    __u16 interp_threads_head;   /* PyInterpreterState: first PyThreadState * */
    __u16 tstate_next;           /* PyThreadState: next */
    __u16 tstate_thread;         /* PyThreadState: the field thread_match compares (8 bytes) */
    __u16 tstate_frame;          /* PyThreadState: frame (3.8-3.10), cframe (3.11-3.12), current_frame (3.13+) */
    __u16 cframe_frame;          /* _PyCFrame: current_frame (with FLAMED_PY_CFRAME) */
    __u16 frame_code;            /* frame: f_code / f_executable */
    __u16 frame_previous;        /* frame: f_back / previous */
    __u16 frame_instr;           /* frame: f_lasti (int) or prev_instr / instr_ptr (pointer) */
    __u16 frame_owner;           /* frame: owner (1 byte), FLAMED_PY_NONE before 3.12 */
    __u16 frame_is_entry;        /* frame: is_entry (1 byte, 3.11), FLAMED_PY_NONE elsewhere */
    __u8 owner_cstack;           /* owner value of a frame owned by the C stack (a shim: skipped) */
    __u8 instr_size;             /* 4: f_lasti is an int, 8: a pointer */
    __u8 frame_windows;          /* windows of the frame stack one walk may read
                                  * (bpf/python.bpf.c, FLAMED_PY_WINDOW): 0 before
                                  * 3.11, whose frames are heap objects */
    /* A stack new in its generation gets a guard per frame: a u32 made of
     * three fields of its code object (py_guard in bpf/python.bpf.c), read
     * in one read of guard_len bytes (<= FLAMED_PY_CODE_BYTES, 0: no guards)
     * at guard_base in the code object; the fields at these offsets from
     * guard_base. */
    __u8 guard_len;
    __u16 guard_base;
    __u8 guard_name;             /* co_qualname (3.11+) or co_name: a pointer */
    __u8 guard_file;             /* co_filename: a pointer */
    __u8 guard_line;             /* co_firstlineno: an int */
    __u8 pad;
    /* The process's PID namespace (device and inode of /proc/PID/ns/pid) when
     * it is not the one whose ids the program sees (a container): 3.11+ keep
     * the namespace's tid in native_thread_id, so the match compares it with
     * the task's tid in that namespace.  Both 0 on the host. */
    __u64 ns_dev;
    __u64 ns_ino;
    /* [gil_lo, gil_hi): where the main interpreter's GIL lives (the
     * _PyRuntime symbol, which holds it inline on 3.8-3.13).  A thread that
     * blocks in futex() on an address there waits for the GIL.  0, 0: unknown. */
    __u64 gil_lo;
    __u64 gil_hi;
};

/* The Python stack id of a sample of a described process whose thread state
 * was not found (a native thread, or one not reached yet in a long thread
 * list): user space shows it as a marker frame.  Real stack ids avoid it. */
#define FLAMED_PY_ID_NO_THREAD 0xfffffffffffffff1ULL

/* One Python frame as the program emits it: the code object's address with
 * bit 0 set on the first (outermost) frame of one run of the evaluation loop
 * (where the native stack shows a _PyEval_EvalFrameDefault), and a 32-bit
 * instruction position: f_lasti as the frame holds it (instr_size 4), or the
 * instruction pointer minus the code object's address (instr_size 8). */
#define FLAMED_PY_ENTRY_BIT 1ULL

/* flamed_pystack.flags */
#define FLAMED_PYSTACK_TRUNCATED 1   /* more frames than FLAMED_PY_DEPTH: the outermost are missing */
#define FLAMED_PYSTACK_READ_FAULT 2  /* a frame could not be read: the walk stopped there */
#define FLAMED_PYSTACK_GUARDED 4     /* guard[] holds each frame's code object guard (0: not read).
                                      * Set after the stack's id is made: not part of it. */


/* ---- Native stacks unwound by the program (bpf/unwind.bpf.c) ----
 *
 * User space (flamed/sampling/unwind/) builds a table of rows per binary from
 * its .eh_frame and loads the rows into one array; each process gets the list
 * of its executable mappings that have a table.  Row kinds: */
#define FLAMED_UW_NONE 0          /* no CFI here: follow the frame pointer */
#define FLAMED_UW_CFA_RSP 1       /* CFA = rsp + 8 * cfa8 */
#define FLAMED_UW_CFA_RBP 2       /* CFA = rbp + 8 * cfa8 */
#define FLAMED_UW_PLT 3           /* CFA = rsp + 8 * cfa8, + 8 when (addr & 15) >= rbp */
#define FLAMED_UW_STOP 4          /* the return address is undefined: outermost frame */
#define FLAMED_UW_UNSUPPORTED 5   /* a DWARF expression or another register */

/* flamed_ustack.end: why the walk ended */
#define FLAMED_UW_END_COMPLETE 0
#define FLAMED_UW_END_NO_TABLE 1
#define FLAMED_UW_END_UNSUPPORTED 2
#define FLAMED_UW_END_DEPTH 3
#define FLAMED_UW_END_READ_FAULT 4

/* One row: from pc (a file virtual address) to the next row's pc. */
struct flamed_uw_row {
    __u32 pc;
    __u16 cfa8;
    __u8 kind;
    __u8 rbp;  /* rbp saved at CFA - 8 * rbp; 0: not saved (unchanged) */
};

/* A table's page index: for vaddr v of a table whose index begins at `base`,
 * bucket b = (v - base) >> FLAMED_UW_PAGE_SHIFT holds the row in effect at v
 * between the table's rows P[b] - 1 and P[b + 1] - 1, where P[b] is the
 * number of its rows whose pc is below base + (b << FLAMED_UW_PAGE_SHIFT).
 * P[0..pages] (pages + 1 entries) is stored in uw_rows itself, two per row
 * slot (P[2i] where a row has its pc, P[2i + 1] in its other four bytes),
 * in the slots just before the table's rows, so a table is one contiguous
 * range.  The search then touches a few cache lines of one bucket instead of
 * log2(rows) lines spread over the whole table. */
#define FLAMED_UW_PAGE_SHIFT 10

/* One executable mapping with a table: addr - bias is the file vaddr. */
struct flamed_uw_map {
    __u64 start;
    __u64 end;
    __u64 bias;
    __u32 first;  /* first row in uw_rows */
    __u32 index;  /* uw_rows slot of the table's page index (P[0], P[1]) */
    __u32 base;   /* vaddr of bucket 0, a multiple of 1 << FLAMED_UW_PAGE_SHIFT */
    __u32 pages;  /* buckets; 0: no rows loaded (frame pointers) */
    __u32 serial; /* names this load of the table: never reused (see uw_row_cache) */
    __u32 pad;
};

#endif /* FLAMED_H */
