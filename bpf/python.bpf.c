/* python.bpf.c -- CPython frames read by flamed's sampler.  With FLAMED_PYTHON=1
 * the loader appends this file to profile.bpf.c (one text: bcc rewrites map
 * calls only in the text it compiles, not in included files).
 *
 * What: for a sample of a process user space has described in `pyprocs`
 * (struct flamed_pyproc, filled from the interpreter's layout by
 * flamed/sampling/cpython/), find the sampled thread's PyThreadState and walk
 * its frame chain, emitting per frame the code object address (bit 0: first
 * frame of one run of the evaluation loop) and the instruction position.  The
 * stack is stored once per generation in `pystacks*` under a 64-bit hash of
 * its frames, and the hash goes into the count key, so only unique Python
 * stacks cross to user space, like the kernel and native ones.  A stack seen
 * for the first time in a generation is reported through `py_new`, so user
 * space names its code objects while the process still runs.  Before that,
 * at the end of the same sample, each of its frames gets a guard read from
 * its code object (flamed_pyguard, tail-called): a code object freed and
 * another made at its address by the time user space names it shows as a
 * guard that differs.  Samples of stacks already stored pay nothing for it.
 *
 * Why in the kernel: the Python stack is read at the instant of the sample,
 * on the thread that was interrupted, so every kernel and native frame lands
 * under the Python function that ran it; no external sampler per process.
 *
 * Header safety: the only kernel struct read is the task's fs base (3.8-3.10
 * thread match), at FLAMED_TASK_FSBASE_OFF, which user space takes from the
 * running kernel's BTF; -1 disables that match.  Everything else is user
 * memory at offsets from the process's own interpreter layout.
 *
 * Defines (flamed/sampling/bpf.py passes them):
 *   FLAMED_PY_DEPTH          Python frames kept per stack (power of 2, default 128)
 *   FLAMED_PY_STACK_ENTRIES  distinct Python stacks per generation (default 2048)
 *   FLAMED_PY_MAX_PROCS      CPython processes described at once (default 4096)
 *   FLAMED_PY_MAX_THREADS    thread states looked at per sample (default 128; a longer
 *                            list is searched over several samples, see py_cursors)
 *   FLAMED_TASK_FSBASE_OFF   offset of thread.fsbase in task_struct, or -1
 *   FLAMED_PY_TIMING         1: add the ns each walk takes to FLAMED_STAT_PY_NS
 *                            (for bench/python_bpf.py; two clock reads a sample)
 */
#ifndef FLAMED_PY_DEPTH
#define FLAMED_PY_DEPTH 128
#endif
#ifndef FLAMED_PY_STACK_ENTRIES
#define FLAMED_PY_STACK_ENTRIES 2048
#endif
#ifndef FLAMED_PY_MAX_PROCS
#define FLAMED_PY_MAX_PROCS 4096
#endif
#ifndef FLAMED_PY_MAX_THREADS
#define FLAMED_PY_MAX_THREADS 128
#endif
#ifndef FLAMED_PY_TIMING
#define FLAMED_PY_TIMING 0
#endif
#ifndef FLAMED_TASK_FSBASE_OFF
#define FLAMED_TASK_FSBASE_OFF -1
#endif
/* Bytes of a thread's frame stack read at once (3.11+: a power of 2, at most
 * a page; 0: one read per frame).  From 3.11 the interpreter keeps a
 * thread's frames one after the other in its data stack, each caller below
 * its callee, so one read below the innermost frame usually holds several
 * of its callers: a read costs the same ~70 ns whether it copies 128 bytes
 * or 2 KiB, and a frame was one read.  A window never reaches below the
 * page of the frame it was read for, so it faults only where reading that
 * frame alone would. */
#ifndef FLAMED_PY_WINDOW
#define FLAMED_PY_WINDOW 2048
#endif

/* A Python stack: innermost frame first.  guard[] is meaningful only with
 * FLAMED_PYSTACK_GUARDED in flags; a 0 there is a guard that was not read. */
struct flamed_pystack {
    __u32 len;
    __u32 flags; /* FLAMED_PYSTACK_* */
    __u64 code[FLAMED_PY_DEPTH];
    __u32 instr[FLAMED_PY_DEPTH];
    __u32 guard[FLAMED_PY_DEPTH];
};

/* What a frame step needs of one frame (scalars: the verifier can merge the
 * states of the paths that read it from the window and from its own read). */
struct flamed_py_fields {
    u64 code;
    u64 prev;
    u64 instr;
    u8 owner; /* 0xff: the layout has no owner field */
    u8 entry;
};

/* The frame walk's state.  In the per-CPU scratch, not on the program's
 * stack, which the rest of the sample fills to its 512-byte limit; values
 * in map memory are also unknown to the verifier, so the paths of one frame
 * step (read from the window or alone, a shim skipped or not) lead to one
 * state at the next step. */
struct flamed_py_walk {
    __u64 frame;
    __u64 hash;
    __u32 n;
    __u32 flags;
    __u16 off_code;
    __u16 off_previous;
    __u16 off_instr;
    __u16 off_owner;
    __u16 off_entry;
    __u8 owner_cstack;
    __u8 instr_size;
    __u8 every_entry;
    /* Windows left to read in this walk: struct flamed_pyproc's
     * frame_windows (FRAME_WINDOWS in flamed/sampling/cpython/layout.py for
     * 3.11+, 0 before), then one read per frame: frames outside the data
     * stack, such as generators', each miss the window. */
    __u8 windows;
    __u8 pad[2];
};

/* A new stack whose guards flamed_pyguard is to read, at the end of the
 * sample that stored it (the stack itself is still in the scratch). */
struct flamed_py_pending {
    __u64 id;
    __u32 tgid;
    __u32 gen;
    __u16 base;
    __u8 len;
    __u8 at_name;
    __u8 at_file;
    __u8 at_line;
    __u8 on; /* 1: to do */
    __u8 pad;
};

/* Per-CPU scratch: the stack being built and the last bytes read. */
struct flamed_py_scratch {
    struct flamed_pystack stack;
    /* 8 bytes of slack: a masked offset + 8 stays inside, which the
     * verifier can see (user space keeps offsets <= size - 8 anyway). */
    __u8 tstate[FLAMED_PY_TSTATE_BYTES + 8];
    __u8 frame[FLAMED_PY_FRAME_BYTES + 8];
    /* The fields of the frame being emitted (here: the program's stack is full). */
    struct flamed_py_fields ff;
    struct flamed_py_walk walk;
    __u64 wbase; /* address of window's first byte; 0: no window */
    /* A code object's guard fields, read by flamed_pyguard (+ 8 bytes of slack). */
    __u8 code[FLAMED_PY_CODE_BYTES + 8];
    struct flamed_py_pending pending;
#if FLAMED_PY_WINDOW
    __u8 window[FLAMED_PY_WINDOW + FLAMED_PY_FRAME_BYTES + 8];
#endif
};

#define PY_TS_OFF(o) ((o) & (FLAMED_PY_TSTATE_BYTES - 1))
#define PY_FR_OFF(o) ((o) & (FLAMED_PY_FRAME_BYTES - 1))

struct flamed_py_find {
    __u64 tstate;
    __u64 want;
    __u16 off_next;
    __u16 off_thread;
    __u32 found;
};

struct flamed_py_new {
    __u32 tgid;
    __u32 gen;
    __u64 id;
};

BPF_HASH(pyprocs, u32, struct flamed_pyproc, FLAMED_PY_MAX_PROCS);
/* tid -> its PyThreadState: threads keep theirs for life, so the list walk
 * happens once per thread; each use re-checks the thread field. */
BPF_TABLE("lru_hash", u32, u64, py_tstates, FLAMED_PY_MAX_PROCS * 4);
/* tid -> the thread state where the next search of its thread list resumes:
 * a list longer than FLAMED_PY_MAX_THREADS (a big thread pool, newest first,
 * so old busy threads sit at its end) is searched FLAMED_PY_MAX_THREADS
 * entries per sample, each sample going on where the last one stopped, until
 * the thread is found (then cached above) or the end is reached. */
BPF_TABLE("lru_hash", u32, u64, py_cursors, FLAMED_PY_MAX_PROCS * 4);
BPF_PERCPU_ARRAY(py_scratch, struct flamed_py_scratch, 1);
BPF_HASH(pystacks0, u64, struct flamed_pystack, FLAMED_PY_STACK_ENTRIES);
BPF_HASH(pystacks1, u64, struct flamed_pystack, FLAMED_PY_STACK_ENTRIES);
BPF_PERF_OUTPUT(py_new);
/* flamed_pyguard, set by user space after loading (flamed/sampling/program.py). */
BPF_PROG_ARRAY(py_progs, 1);


/* One step through the interpreter's thread list: 1 when `f->tstate` is the
 * sampled thread's (its bytes are then in s->tstate), 0 to go on. */
static __always_inline int py_find_step(struct flamed_py_scratch *s, struct flamed_py_find *f)
{
    if (!f->tstate)
        return 1;
    if (bpf_probe_read_user(s->tstate, FLAMED_PY_TSTATE_BYTES, (void *)f->tstate) != 0) {
        f->found = 2;
        return 1;
    }
    u64 v = 0;
    __builtin_memcpy(&v, s->tstate + PY_TS_OFF(f->off_thread), 8);
    if (v == f->want) {
        f->found = 1;
        return 1;
    }
    __builtin_memcpy(&v, s->tstate + PY_TS_OFF(f->off_next), 8);
    f->tstate = v;
    return 0;
}

/* The fields of a frame's bytes at fb. */
#define PY_FRAME_FIELDS(fb)                                                    \
    do {                                                                       \
        __builtin_memcpy(&ff->code, (fb) + PY_FR_OFF(w->off_code), 8);         \
        __builtin_memcpy(&ff->prev, (fb) + PY_FR_OFF(w->off_previous), 8);     \
        __builtin_memcpy(&ff->instr, (fb) + PY_FR_OFF(w->off_instr), 8);       \
        ff->owner = w->off_owner != FLAMED_PY_NONE ? (fb)[PY_FR_OFF(w->off_owner)] : 0xff; \
        ff->entry = w->off_entry != FLAMED_PY_NONE ? (fb)[PY_FR_OFF(w->off_entry)] : 0; \
    } while (0)

#if FLAMED_PY_WINDOW
/* Does the window hold the whole frame at f? */
static __always_inline int py_in_window(struct flamed_py_scratch *s, u64 f)
{
    return s->wbase && f >= s->wbase && f - s->wbase <= FLAMED_PY_WINDOW - FLAMED_PY_FRAME_BYTES;
}
#endif

/* Read the frame at w->frame, from the window when it holds it; 0 on failure. */
static __always_inline int py_read_frame(struct flamed_py_scratch *s, struct flamed_py_walk *w,
                                         struct flamed_py_fields *ff)
{
    u64 f = w->frame;
#if FLAMED_PY_WINDOW
    if (!py_in_window(s, f) && w->windows) {
        u64 base = f + FLAMED_PY_FRAME_BYTES - FLAMED_PY_WINDOW;
        u64 page = f & ~4095ULL;
        if (base < page || base > f)
            base = page;
        if (bpf_probe_read_user(s->window, FLAMED_PY_WINDOW, (void *)base) == 0) {
            s->wbase = base;
        } else {
            s->wbase = 0;
        }
        w->windows--;
    }
    if (py_in_window(s, f)) {
        u8 *fb = s->window + ((f - s->wbase) & (FLAMED_PY_WINDOW - 1));
        PY_FRAME_FIELDS(fb);
        return 1;
    }
#endif
    if (bpf_probe_read_user(s->frame, FLAMED_PY_FRAME_BYTES, (void *)f) != 0) {
        w->flags |= FLAMED_PYSTACK_READ_FAULT;
        return 0;
    }
    PY_FRAME_FIELDS(s->frame);
    return 1;
}

/* Emit frame n (< FLAMED_PY_DEPTH): 1 to go on, 0 at the end of the chain.
 * The loop counter is the frame index itself, so the verifier sees one state
 * per frame: a shim frame of the C stack (3.12+; never two in a row) is
 * skipped inside the same step by reading the frame before it. */
static __always_inline int py_frame_step(struct flamed_py_scratch *s, struct flamed_py_walk *w, u32 n)
{
    struct flamed_py_fields *ff = &s->ff;
    if (!w->frame)
        return 0;
    if (!py_read_frame(s, w, ff))
        return 0;
    if (w->off_owner != FLAMED_PY_NONE && ff->owner == w->owner_cstack) {
        /* The frame emitted before this shim began a run of the
         * evaluation loop. */
        if (n > 0 && n <= FLAMED_PY_DEPTH)
            s->stack.code[(n - 1) & (FLAMED_PY_DEPTH - 1)] |= FLAMED_PY_ENTRY_BIT;
        w->frame = ff->prev;
        if (!w->frame)
            return 0;
        if (!py_read_frame(s, w, ff))
            return 0;
    }
    u64 code = ff->code;
    u32 pos;
    if (w->instr_size == 4)
        pos = (u32)ff->instr;
    else
        pos = (u32)(ff->instr - code); /* bytes from the code object to the instruction */
    if (w->every_entry || ff->entry)
        code |= FLAMED_PY_ENTRY_BIT;
    if (n >= FLAMED_PY_DEPTH)
        return 0;
    s->stack.code[n] = code;
    s->stack.instr[n] = pos;
    w->hash = flamed_mix(flamed_mix(w->hash, code), pos);
    w->n = n + 1;
    w->frame = ff->prev;
    return 1;
}

/* A code object's guard: its name and file name (pointers to the string
 * objects, kept for the code object's life) and first line, mixed into 32
 * bits, never 0.  flamed/sampling/cpython/layout.py code_guard computes the
 * same from the bytes user space reads. */
static __always_inline u32 py_guard(u64 name, u64 file, u32 line)
{
    u64 h = flamed_mix(flamed_mix(flamed_mix(0, name), file), line);
    u32 g = (u32)(h ^ (h >> 32));
    return g ? g : 1;
}

/* Report a new stack through py_new: user space names it now. */
static __always_inline void py_report_new(struct bpf_perf_event_data *ctx, u32 tgid, u32 gen, u64 id)
{
    struct flamed_py_new e = {};
    e.tgid = tgid;
    e.gen = gen;
    e.id = id;
    py_new.perf_submit(ctx, &e, sizeof(e));
}

/* Report the pending new stack, done. */
static __always_inline void py_report_pending(struct bpf_perf_event_data *ctx, struct flamed_py_scratch *s)
{
    s->pending.on = 0;
    py_report_new(ctx, s->pending.tgid, s->pending.gen, s->pending.id);
}

/* The end of a sample that stored a new Python stack with guards to read:
 * flamed_pyguard reads them and ends the sample (the in-flight section).
 * Returns when there is nothing to do, or the tail call failed (the stack is
 * then reported unguarded, named as without guards): the caller ends the
 * sample itself.  The off-CPU program never leaves a stack pending (its
 * py_take reports at once), so one interrupting it cannot take its report. */
static __always_inline void py_guard_end(struct bpf_perf_event_data *ctx)
{
    u32 zero = 0;
    struct flamed_py_scratch *s = py_scratch.lookup(&zero);
    if (!s || !s->pending.on)
        return;
    py_progs.call(ctx, 0);
    py_report_pending(ctx, s);
}

/* The fs base of the current task: what pthread_self() returns in it. */
static __always_inline u64 py_fsbase(void)
{
#if FLAMED_TASK_FSBASE_OFF >= 0
    u64 fs = 0;
    void *task = (void *)bpf_get_current_task();
    bpf_probe_read_kernel(&fs, sizeof(fs), task + FLAMED_TASK_FSBASE_OFF);
    return fs;
#else
    return 0;
#endif
}

/* Walk the sampled thread's Python frames into the generation's pystacks;
 * the stack's id (0: none) for the count key.  ``guard``: a constant, 0 for a
 * caller that does not end in py_guard_end (a new stack is then reported at
 * once, without guards). */
static __always_inline u64 py_take(struct bpf_perf_event_data *ctx, u32 gen, u32 tgid, u32 tid, int guard)
{
    struct flamed_pyproc *pp = pyprocs.lookup(&tgid);
    if (!pp)
        return 0;
    stat_inc(gen, FLAMED_STAT_PY_SAMPLES);
    u32 zero = 0;
    struct flamed_py_scratch *s = py_scratch.lookup(&zero);
    if (!s)
        return 0;

    struct flamed_py_find f = {};
    f.off_next = pp->tstate_next;
    f.off_thread = pp->tstate_thread;
    if (pp->thread_match == FLAMED_PY_MATCH_FSBASE) {
        f.want = py_fsbase();
        if (!f.want) {
            stat_inc(gen, FLAMED_STAT_PY_NO_THREAD);
            return FLAMED_PY_ID_NO_THREAD;
        }
    } else if (pp->ns_ino) {
        /* A process in its own PID namespace keeps that namespace's tid. */
        struct bpf_pidns_info ns = {};
        if (bpf_get_ns_current_pid_tgid(pp->ns_dev, pp->ns_ino, &ns, sizeof(ns)) != 0) {
            stat_inc(gen, FLAMED_STAT_PY_NO_THREAD);
            return FLAMED_PY_ID_NO_THREAD;
        }
        f.want = ns.pid;
    } else {
        f.want = tid;
    }

    /* The cached thread state first, the interpreter's list otherwise. */
    u64 *cached = py_tstates.lookup(&tid);
    if (cached) {
        f.tstate = *cached;
        py_find_step(s, &f);
    }
    if (f.found != 1) {
        f.found = 0;
        f.tstate = 0;
        u64 *resume = py_cursors.lookup(&tid);
        if (resume)
            f.tstate = *resume;
        if (!f.tstate) {
            u64 interp = 0;
            if (bpf_probe_read_user(&interp, sizeof(interp), (void *)pp->interp_addr) != 0 || !interp) {
                stat_inc(gen, FLAMED_STAT_PY_NO_THREAD);
                return FLAMED_PY_ID_NO_THREAD;
            }
            bpf_probe_read_user(&f.tstate, sizeof(f.tstate), (void *)(interp + pp->interp_threads_head));
        }
#pragma clang loop unroll(disable)
        for (u32 i = 0; i < FLAMED_PY_MAX_THREADS; i++) {
            if (py_find_step(s, &f))
                break;
        }
        if (f.found != 1) {
            if (f.found == 0 && f.tstate) {
                /* Bound reached inside the list: the next sample goes on from here. */
                py_cursors.update(&tid, &f.tstate);
            } else if (resume) {
                py_cursors.delete(&tid);
            }
            if (f.found == 2) {
                stat_inc(gen, FLAMED_STAT_PY_READ_FAULT);
                return 0;
            }
            stat_inc(gen, FLAMED_STAT_PY_NO_THREAD);
            return FLAMED_PY_ID_NO_THREAD;
        }
        if (resume)
            py_cursors.delete(&tid);
        py_tstates.update(&tid, &f.tstate);
    }

    /* s->tstate holds the matched thread state's bytes. */
    u64 frame = 0;
    __builtin_memcpy(&frame, s->tstate + PY_TS_OFF(pp->tstate_frame), 8);
    if (frame && (pp->flags & FLAMED_PY_CFRAME)) {
        u64 cf = frame;
        frame = 0;
        bpf_probe_read_user(&frame, sizeof(frame), (void *)(cf + pp->cframe_frame));
    }
    if (!frame) {
        stat_inc(gen, FLAMED_STAT_PY_NO_FRAME);
        return 0;
    }

    struct flamed_py_walk *w = &s->walk;
    __builtin_memset(w, 0, sizeof(*w));
    w->frame = frame;
    w->hash = 0xcbf29ce484222325ULL ^ tgid;
    w->off_code = pp->frame_code;
    w->off_previous = pp->frame_previous;
    w->off_instr = pp->frame_instr;
    w->off_owner = pp->frame_owner;
    w->off_entry = pp->frame_is_entry;
    w->owner_cstack = pp->owner_cstack;
    w->instr_size = pp->instr_size;
    w->every_entry = pp->version < 0x030b;
    /* From user space, not a constant here: a count the verifier knows
     * exactly would make it explore each frame once per value. */
    w->windows = FLAMED_PY_WINDOW ? pp->frame_windows : 0;
    s->wbase = 0;
#pragma clang loop unroll(disable)
    for (u32 n = 0; n < FLAMED_PY_DEPTH; n++) {
        if (!py_frame_step(s, w, n))
            break;
    }
    if (w->frame && !(w->flags & FLAMED_PYSTACK_READ_FAULT) && w->n >= FLAMED_PY_DEPTH)
        w->flags |= FLAMED_PYSTACK_TRUNCATED;
    if (w->flags & FLAMED_PYSTACK_READ_FAULT)
        stat_inc(gen, FLAMED_STAT_PY_READ_FAULT);
    if (w->flags & FLAMED_PYSTACK_TRUNCATED)
        stat_inc(gen, FLAMED_STAT_PY_TRUNCATED);
    if (w->n == 0) {
        stat_inc(gen, FLAMED_STAT_PY_NO_FRAME);
        return 0;
    }
    s->stack.len = w->n;
    s->stack.flags = w->flags;
    u64 id = flamed_mix(w->hash, w->n ^ ((u64)w->flags << 32));
    if (id == 0 || id == FLAMED_PY_ID_NO_THREAD)
        id ^= 2;

    void *found;
    if (gen)
        found = pystacks1.lookup(&id);
    else
        found = pystacks0.lookup(&id);
    if (!found) {
        int err = gen ? pystacks1.insert(&id, &s->stack) : pystacks0.insert(&id, &s->stack);
        if (err == 0) {
            if (guard && pp->guard_len) {
                /* py_guard_end reads the guards, then reports the stack. */
                struct flamed_py_pending *q = &s->pending;
                q->id = id;
                q->tgid = tgid;
                q->gen = gen;
                q->base = pp->guard_base;
                q->len = pp->guard_len;
                q->at_name = pp->guard_name;
                q->at_file = pp->guard_file;
                q->at_line = pp->guard_line;
                q->on = 1;
            } else {
                py_report_new(ctx, tgid, gen, id);
            }
        } else if (err != -FLAMED_EEXIST) {
            stat_inc(gen, FLAMED_STAT_PY_STACKS_FULL);
            return 0;
        }
    }
    stat_inc(gen, FLAMED_STAT_PY_STACKS);
    return id;
}

/* py_take, timed when asked (only samples of described processes count). */
static __always_inline u64 py_take_timed(struct bpf_perf_event_data *ctx, u32 gen, u32 tgid, u32 tid, int guard)
{
#if FLAMED_PY_TIMING
    if (!pyprocs.lookup(&tgid))
        return 0;
    u64 t0 = bpf_ktime_get_ns();
    u64 id = py_take(ctx, gen, tgid, tid, guard);
    u32 idx = gen * FLAMED_NSTATS + FLAMED_STAT_PY_NS;
    u64 *v = stats.lookup(&idx);
    if (v)
        *v += bpf_ktime_get_ns() - t0;
    return id;
#else
    return py_take(ctx, gen, tgid, tid, guard);
#endif
}

/* The guards of the new stack a sample just stored (struct
 * flamed_py_pending), tail-called at the end of that sample: each frame's
 * code object read now, while the sampled thread is still interrupted, into
 * the stored value's guard[], FLAMED_PYSTACK_GUARDED set, then the stack
 * reported through py_new and the sample's in-flight section closed.  A
 * program of its own, so the verifier walks its loop once, not once for
 * each way the sample got here; steady state (no new stack) never comes. */
int flamed_pyguard(struct bpf_perf_event_data *ctx)
{
    u32 zero = 0;
    struct flamed_py_scratch *s = py_scratch.lookup(&zero);
    if (!s)
        return 0;
    struct flamed_py_pending *q = &s->pending;
    u32 n = s->stack.len;
    u32 len = q->len;
    if (len > FLAMED_PY_CODE_BYTES)
        len = FLAMED_PY_CODE_BYTES;
    u64 base = q->base;
#pragma clang loop unroll(disable)
    for (u32 i = 0; i < FLAMED_PY_DEPTH; i++) {
        if (i >= n)
            break;
        u64 code = s->stack.code[i] & ~FLAMED_PY_ENTRY_BIT;
        u32 g = 0;
        if (bpf_probe_read_user(s->code, len, (void *)(code + base)) == 0) {
            u64 name = 0, file = 0;
            u32 line = 0;
            __builtin_memcpy(&name, s->code + (q->at_name & (FLAMED_PY_CODE_BYTES - 1)), 8);
            __builtin_memcpy(&file, s->code + (q->at_file & (FLAMED_PY_CODE_BYTES - 1)), 8);
            __builtin_memcpy(&line, s->code + (q->at_line & (FLAMED_PY_CODE_BYTES - 1)), 4);
            g = py_guard(name, file, line);
        }
        s->stack.guard[i] = g;
    }
    u64 id = q->id;
    struct flamed_pystack *v;
    if (q->gen)
        v = pystacks1.lookup(&id);
    else
        v = pystacks0.lookup(&id);
    if (v) {
        __builtin_memcpy(v->guard, s->stack.guard, sizeof(v->guard));
        v->flags |= FLAMED_PYSTACK_GUARDED; /* written once, by insert: no other writer */
    }
    py_report_pending(ctx, s);
    u64 *seq = inflight.lookup(&zero);
    if (seq)
        __sync_fetch_and_add(seq, 1);
    return 0;
}
