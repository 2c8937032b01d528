/* offcpu.bpf.c -- off-CPU time: how long selected tasks wait, and where.  With
 * FLAMED_OFFCPU=1 the loader appends this file to profile.bpf.c (after
 * python.bpf.c: one text, as bcc rewrites map calls only in the text it
 * compiles) and attaches flamed_offcpu to the sched_switch BTF raw tracepoint
 * (no tracefs needed).
 *
 * What: when a task the sampler selects (same filters, watched set and idle
 * rule as a CPU sample) leaves a CPU, remember in offcpu_start[tid] when, why
 * (blocked or preempted) and where: kernel stack, frame-pointer user stack
 * and Python stack ids in the current generation's maps, exactly as a CPU
 * sample takes them (the current task in this hook is the one leaving).  When
 * that tid is switched in again, the wait's nanoseconds are added to
 * offcpu_counts of the current generation under those stacks, if the wait
 * lasted at least FLAMED_OFF_MIN_NS.
 *
 * Generations: stack ids are valid until the drain of the generation they
 * were taken in.  A wait that began in an earlier generation than it ends in
 * is not counted by stack: it goes to offcpu_carried (keyed by tid and start
 * time, with its start record); user space read that start's stacks at the
 * drain of the generation it began in and adds the wait to them when the
 * carried record arrives (flamed/sampling/drain.py, docs/offcpu.md).  For
 * that the start keeps the full epoch user space writes to `generation`, not
 * just its parity.
 *
 * GIL waits (FLAMED_GIL_WAIT, x86-64): a described CPython thread that blocks
 * in futex() on an address inside its process's [gil_lo, gil_hi) (the
 * _PyRuntime symbol, where the main interpreter's GIL condition variables and
 * mutexes live) is waiting for the GIL: its start gets FLAMED_OFF_GIL.  The
 * syscall and its first argument come from the task's saved user registers.
 *
 * Header safety: the kernel structs read are the next task's pid, at
 * FLAMED_TASK_PID_OFF, which user space takes from the running kernel's BTF,
 * and pt_regs (orig_ax, di) through bpf_task_pt_regs().
 *
 * Defines (flamed/sampling/program.py passes them):
 *   FLAMED_TASK_PID_OFF   offset of pid in task_struct (required)
 *   FLAMED_OFF_MIN_NS     shortest wait counted, ns (default 1000000)
 *   FLAMED_OFF_STARTS     open waits remembered at once (default 16384)
 *   FLAMED_OFF_ENTRIES    distinct off-CPU keys per generation (default 16384)
 *   FLAMED_OFF_CARRIED    waits spanning a drain, per generation (default 4096)
 *   FLAMED_OFF_EVERY      remember one switch-out in N at random, its wait
 *                         counted N times (default 1: every one); the stack
 *                         walks at switch-out are the cost, see bench/offcpu.py
 */
#ifndef FLAMED_OFF_MIN_NS
#define FLAMED_OFF_MIN_NS 1000000
#endif
#ifndef FLAMED_OFF_STARTS
#define FLAMED_OFF_STARTS 16384
#endif
#ifndef FLAMED_OFF_ENTRIES
#define FLAMED_OFF_ENTRIES 16384
#endif
#ifndef FLAMED_OFF_CARRIED
#define FLAMED_OFF_CARRIED 4096
#endif
#ifndef FLAMED_OFF_EVERY
#define FLAMED_OFF_EVERY 1
#endif
#ifndef FLAMED_GIL_WAIT
#define FLAMED_GIL_WAIT 0
#endif
/* x86-64's futex(2). */
#define FLAMED_NR_FUTEX 202

/* TASK_DEAD in task_struct.__state: the last switch of an exiting task, which
 * never comes back (its start would stay forever). */
#define FLAMED_TASK_DEAD 0x80

BPF_HASH(offcpu_start, u32, struct flamed_offcpu_start, FLAMED_OFF_STARTS);
BPF_HASH(offcpu_counts0, struct flamed_offcpu_key, u64, FLAMED_OFF_ENTRIES);
BPF_HASH(offcpu_counts1, struct flamed_offcpu_key, u64, FLAMED_OFF_ENTRIES);
BPF_HASH(offcpu_carried0, struct flamed_offcpu_carry_key, struct flamed_offcpu_carry, FLAMED_OFF_CARRIED);
BPF_HASH(offcpu_carried1, struct flamed_offcpu_carry_key, struct flamed_offcpu_carry, FLAMED_OFF_CARRIED);
/* Its own in-flight sequence: a perf-event program may interrupt this one on
 * the same CPU, and sharing `inflight` would make it look even meanwhile. */
BPF_PERCPU_ARRAY(offcpu_inflight, u64, 1);
/* ktime of this CPU's last switch the program saw (off_untraced_in). */
BPF_PERCPU_ARRAY(offcpu_last_switch, u64, 1);

/* 0 when counted, -1 when the map was full (the wait is lost). */
static __always_inline int off_add(u32 gen, struct flamed_offcpu_key *k, u64 ns)
{
    u64 *v = gen ? offcpu_counts1.lookup(k) : offcpu_counts0.lookup(k);
    if (!v) {
        int err = gen ? offcpu_counts1.insert(k, &ns) : offcpu_counts0.insert(k, &ns);
        if (err == 0) {
            stat_inc(gen, FLAMED_STAT_OFF_COUNTED);
            return 0;
        }
        /* Another CPU may have inserted the same key meanwhile. */
        v = gen ? offcpu_counts1.lookup(k) : offcpu_counts0.lookup(k);
        if (!v) {
            stat_inc(gen, FLAMED_STAT_OFF_MAP_FULL);
            return -1;
        }
    }
    __sync_fetch_and_add(v, ns);
    stat_inc(gen, FLAMED_STAT_OFF_COUNTED);
    return 0;
}

/* A recorded wait's stacks lost at its switch-out (flamed_offcpu_start.lost):
 * a loss now, not before (most waits end below the threshold). */
static __always_inline void off_count_lost(u32 gen, u32 lost)
{
    if (lost & 0xff)
        stat_inc(gen, lost & 0xff);
    if (lost >> 8)
        stat_inc(gen, lost >> 8);
}

/* The wait remembered in `st` for `tid` ended at `end`: count it, forget it. */
static __always_inline void off_end(u32 tid, struct flamed_offcpu_start *st, u32 epoch, u64 end)
{
    u32 gen = epoch & 1;
    u64 ns = end > st->ktime_ns ? end - st->ktime_ns : 0;
    if (ns < FLAMED_OFF_MIN_NS) {
        stat_inc(gen, FLAMED_STAT_OFF_BELOW);
        goto done;
    }
    /* One wait in FLAMED_OFF_EVERY was remembered: it stands for them all. */
    ns *= FLAMED_OFF_EVERY;
    if (st->epoch == epoch) {
        struct flamed_offcpu_key k = {};
        k.key.tgid = st->tgid;
        k.key.tid = tid;
        k.key.kernel_stack_id = st->kernel_stack_id;
        k.key.user_stack_id = st->user_stack_id;
        __builtin_memcpy(k.key.comm, st->comm, FLAMED_COMM_LEN);
        k.key.py_stack_id = st->py_stack_id;
        k.key.cgroup_id = st->cgroup_id;
        k.flags = st->flags;
        if (off_add(gen, &k, ns) == 0)
            off_count_lost(gen, st->lost);
    } else {
        /* The start's stack ids belong to a drained generation. */
        struct flamed_offcpu_carry_key ck = {};
        ck.tid = tid;
        ck.ktime_ns = st->ktime_ns;
        struct flamed_offcpu_carry c = {};
        __builtin_memcpy(&c.start, st, sizeof(c.start));
        c.ns = ns;
        int err = gen ? offcpu_carried1.update(&ck, &c) : offcpu_carried0.update(&ck, &c);
        stat_inc(gen, err == 0 ? FLAMED_STAT_OFF_CARRIED : FLAMED_STAT_OFF_CARRY_FULL);
        if (err == 0)
            off_count_lost(gen, st->lost);
    }
done:
    /* After the carried record is written: a drain that no longer finds the
     * start finds the record (see drain.py). */
    offcpu_start.delete(&tid);
}

/* `tid` runs again: count its wait, if one was remembered. */
static __always_inline void off_switch_in(u32 tid, u32 epoch, u64 now)
{
    struct flamed_offcpu_start *st = offcpu_start.lookup(&tid);
    if (st)
        off_end(tid, st, epoch, now);
}

/* The current task leaves the CPU with a wait still open: it was put back on
 * this CPU by a switch this program did not see (the kernel does not run it
 * for every switch: some tasks' switches away are not traced).  That switch
 * came after this CPU's last traced one, `last`, which ran the untraced task:
 * the wait is ended there, short by that task's run time. */
static __always_inline void off_untraced_in(u32 tid, u32 epoch, u64 last)
{
    struct flamed_offcpu_start *st = offcpu_start.lookup(&tid);
    if (!st)
        return;
    stat_inc(epoch & 1, FLAMED_STAT_OFF_STALE);
    off_end(tid, st, epoch, last);
}

#if FLAMED_PYTHON && FLAMED_GIL_WAIT
/* Does the current task block in futex() on its interpreter's GIL? */
static __always_inline int off_gil_wait(u32 tgid)
{
    struct flamed_pyproc *pp = pyprocs.lookup(&tgid);
    if (!pp || !pp->gil_hi)
        return 0;
    struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(bpf_get_current_task_btf());
    u64 nr = 0, uaddr = 0;
    if (bpf_probe_read_kernel(&nr, sizeof(nr), &regs->orig_ax) ||
        bpf_probe_read_kernel(&uaddr, sizeof(uaddr), &regs->di))
        return 0;
    return nr == FLAMED_NR_FUTEX && uaddr >= pp->gil_lo && uaddr < pp->gil_hi;
}
#endif

/* The switch-out's stack ids, as a sample's (-ENODATA: no kernel frame, which
 * in schedule() there must be): the slots of the failed ones for
 * flamed_offcpu_start.lost, and the failures counted as stack map pressure
 * (FLAMED_STAT_OFF_FETCH_*), not as losses: the wait may end below the
 * threshold and never be recorded. */
static __always_inline u32 off_stack_failures(u32 gen, s32 *kidp, s32 uid)
{
    s32 kid = *kidp;
    u32 ks = 0, us = 0;
    if (kid == -FLAMED_EFAULT) {
        *kidp = -FLAMED_ENODATA;
        ks = FLAMED_STAT_OFF_KSTACK_MISSING;
    } else if (kid < 0) {
        ks = kid == -FLAMED_EEXIST ? FLAMED_STAT_OFF_KSTACK_EEXIST
           : kid == -FLAMED_ENOMEM ? FLAMED_STAT_OFF_KSTACK_ENOMEM : FLAMED_STAT_OFF_KSTACK_ERROR;
        stat_inc(gen, FLAMED_STAT_OFF_FETCH_EEXIST + ks - FLAMED_STAT_OFF_KSTACK_EEXIST);
    }
    /* -EFAULT: no user frames (a kernel thread); a task in schedule() is in kernel mode. */
    if (uid < 0 && uid != -FLAMED_EFAULT) {
        us = uid == -FLAMED_EEXIST ? FLAMED_STAT_OFF_USTACK_EEXIST
           : uid == -FLAMED_ENOMEM ? FLAMED_STAT_OFF_USTACK_ENOMEM : FLAMED_STAT_OFF_USTACK_ERROR;
        stat_inc(gen, FLAMED_STAT_OFF_FETCH_EEXIST + us - FLAMED_STAT_OFF_USTACK_EEXIST);
    }
    return ks | us << 8;
}

/* The current task leaves the CPU: remember when, why and where. */
static __always_inline void off_switch_out(struct bpf_raw_tracepoint_args *ctx, u32 epoch, u64 now,
                                           u32 prev_state, struct flamed_key *key)
{
    u32 gen = epoch & 1;
    stat_inc(gen, FLAMED_STAT_OFF_SWITCHES);
#if FLAMED_OFF_EVERY > 1
    if (bpf_get_prandom_u32() % FLAMED_OFF_EVERY)
        return;
#endif
    struct flamed_offcpu_start st = {};
    st.ktime_ns = now;
    st.epoch = epoch;
    st.tgid = key->tgid;
    st.cgroup_id = key->cgroup_id;
    st.flags = prev_state == 0 ? FLAMED_OFF_PREEMPTED : 0;
#if FLAMED_PYTHON && FLAMED_GIL_WAIT
    if (prev_state != 0 && off_gil_wait(key->tgid))
        st.flags |= FLAMED_OFF_GIL;
#endif
    __builtin_memcpy(st.comm, key->comm, FLAMED_COMM_LEN);
    /* In schedule(): a kernel stack must exist, a user one only for user tasks. */
    if (gen) {
        st.kernel_stack_id = stacks1.get_stackid(ctx, 0);
        st.user_stack_id = stacks1.get_stackid(ctx, BPF_F_USER_STACK);
    } else {
        st.kernel_stack_id = stacks0.get_stackid(ctx, 0);
        st.user_stack_id = stacks0.get_stackid(ctx, BPF_F_USER_STACK);
    }
#if FLAMED_PYTHON
    st.py_stack_id = py_take_timed((struct bpf_perf_event_data *)ctx, gen, key->tgid, key->tid, 0);
#endif
    /* Not counted as lost here: the wait may end below the threshold and
     * never be recorded (off_end counts the losses of recorded waits).
     * After the Python walk: the verifier would walk it once per outcome. */
    st.lost = off_stack_failures(gen, &st.kernel_stack_id, st.user_stack_id);
    /* (An open start of this tid was ended by off_untraced_in.) */
    if (offcpu_start.insert(&key->tid, &st) == 0)
        stat_inc(gen, FLAMED_STAT_OFF_STARTS);
    else
        stat_inc(gen, FLAMED_STAT_OFF_START_FULL);
}

/* sched_switch(bool preempt, struct task_struct *prev, struct task_struct *next,
 * unsigned int prev_state): the current task is prev. */
int flamed_offcpu(struct bpf_raw_tracepoint_args *ctx)
{
    u32 next_tid = 0;
    bpf_probe_read_kernel(&next_tid, sizeof(next_tid), (void *)ctx->args[2] + FLAMED_TASK_PID_OFF);
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    u32 prev_state = (u32)ctx->args[3];

    u32 slot = 0;
    u64 *seq = offcpu_inflight.lookup(&slot);
    if (!seq)
        return 0;
    /* Odd while this program uses a generation (as in flamed_sample); the
     * whole epoch, not its parity, tells a wait that spans a drain. */
    __sync_fetch_and_add(seq, 1);
    u32 *epochp = generation.lookup(&slot);
    u32 epoch = epochp ? *epochp : 0;
    u64 now = bpf_ktime_get_ns();
    u64 last = now;
    u64 *lastp = offcpu_last_switch.lookup(&slot);
    if (lastp) {
        last = *lastp;
        *lastp = now;
    }
    if (next_tid)
        off_switch_in(next_tid, epoch, now);

    if (tid == 0)
        goto out;
    struct flamed_key key = {};
    key.tgid = id >> 32;
    key.tid = tid;
    int is_watched = is_watched_tgid(key.tgid);
#if FLAMED_FILTER_PIDS
    /* Most switches on a host are of other processes: out before reading
     * the comm and the cgroup (this runs on every switch of every CPU). */
    if (!is_watched && !filter_pids.lookup(&key.tgid))
        goto out;
#endif
    /* Before the comm and cgroup filters and the exit check: a wait that
     * began while the task passed them, or a task exiting, still ends. */
    off_untraced_in(tid, epoch, last);
    if (prev_state & FLAMED_TASK_DEAD)
        goto out;
    bpf_get_current_comm(&key.comm, sizeof(key.comm));
    key.cgroup_id = bpf_get_current_cgroup_id();
    if (!is_watched && !wanted(&key))
        goto out;
#if FLAMED_PRIME
    /* A process that mostly waits may not be sampled on a CPU before its
     * first wait: its maps are read now all the same. */
    report_new_image((struct bpf_perf_event_data *)ctx, &key);
#endif
    off_switch_out(ctx, epoch, now, prev_state, &key);
out:
    __sync_fetch_and_add(seq, 1);
    return 0;
}
