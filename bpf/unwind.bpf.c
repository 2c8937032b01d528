/* unwind.bpf.c -- native user stacks unwound from .eh_frame tables.  With
 * FLAMED_UNWIND=1 the loader appends this file to profile.bpf.c (one text, like
 * python.bpf.c).
 *
 * What: for a sample of a process user space has described in `uw_procs`
 * (its executable mappings that have a table), walk the user stack from the
 * registers of the interrupted user context: for each frame find the mapping
 * of the address, the table row in effect there (binary search over the
 * binary's rows in `uw_rows`, narrowed by its page index), compute the canonical frame address (CFA) from
 * rsp or rbp, read the return address at CFA - 8 and, where the row says so,
 * the caller's rbp.  An address no table covers (JIT code, a library loaded
 * after the process was described, a binary without CFI) is followed by its
 * frame pointer.  The stack is stored once per generation in `ustacks*` under
 * a 64-bit hash of its callers' addresses, and the hash goes into the count
 * key with the leaf address beside it (struct flamed_key: native_leaf).
 *
 * How: flamed_sample saves the sample's key and the user registers in a
 * per-CPU scratch and tail-calls flamed_unwind, which walks
 * FLAMED_UW_FRAMES_PER_CALL frames and tail-calls itself until the walk ends,
 * then stores the stack and tail-calls flamed_finish, which counts the sample
 * (the end of flamed_sample).  Each program is verified on its own: a loop
 * over all frames in one program exceeds the verifier's budget beyond ~16
 * frames, because every frame's exits multiply the states it explores.
 *
 * Why in the kernel: programs built without frame pointers (most of a
 * distribution, CPython included) lose every caller of a frame-pointer walk,
 * and nothing in such a stack says so.  Here every stack says how it ended
 * (struct flamed_ustack.end), and the reasons are counted.
 *
 * Why: no kernel struct is read.  The user registers of a task interrupted
 * in kernel mode come from bpf_task_pt_regs(), whose struct pt_regs layout is
 * the architecture's ABI.
 *
 * Defines (flamed/sampling/bpf.py passes them):
 *   FLAMED_UW_DEPTH          frames kept per stack (default 64, at most 127)
 *   FLAMED_UW_FRAMES_PER_CALL frames per tail call of flamed_unwind (default 8)
 *   FLAMED_UW_ROWS           rows of all tables together (default 2097152)
 *   FLAMED_UW_MAPS           mappings with a table per process (power of 2, default 64)
 *   FLAMED_UW_MAX_PROCS      processes described at once (default 4096)
 *   FLAMED_UW_STACK_ENTRIES  distinct unwound stacks per generation (default 8192)
 *   FLAMED_UW_TIMING         1: add the ns each walk takes to FLAMED_STAT_UW_NS
 *   FLAMED_UW_ROW_CACHE      rows remembered per CPU (power of 2, default 4096; 0: none)
 */
#ifndef FLAMED_UW_DEPTH
#define FLAMED_UW_DEPTH 64
#endif
#ifndef FLAMED_UW_FRAMES_PER_CALL
#define FLAMED_UW_FRAMES_PER_CALL 8
#endif
#ifndef FLAMED_UW_ROWS
#define FLAMED_UW_ROWS 2097152
#endif
#ifndef FLAMED_UW_MAPS
#define FLAMED_UW_MAPS 64
#endif
#ifndef FLAMED_UW_MAX_PROCS
#define FLAMED_UW_MAX_PROCS 4096
#endif
#ifndef FLAMED_UW_STACK_ENTRIES
#define FLAMED_UW_STACK_ENTRIES 8192
#endif
#ifndef FLAMED_UW_TIMING
#define FLAMED_UW_TIMING 0
#endif
/* Bytes of the user stack copied at once (a power of 2, at most a page; 0:
 * one read per saved value).  A walk reads each frame's return address and
 * often its saved rbp, 8 bytes each, and callers' frames lie just above
 * their callees': one copy from a little below the first value it needs
 * serves the next frames' reads while they fall inside it, and a read
 * costs about the same for 8 bytes as for 2 KiB.  A copy that fails (the
 * end of the stack's mapping is within it) stops copies for the rest of
 * the walk: its values are then read one by one. */
#ifndef FLAMED_UW_WINDOW
#define FLAMED_UW_WINDOW 2048
#endif
/* The row search of a frame (its mapping's page index, then a binary search
 * of one bucket) touches several cache lines of a 16 MB array, cold at
 * every sample: at 99 Hz the rest of the machine has run in between.  The
 * return addresses of a process recur from sample to sample (a Python
 * process's ~10 frames of its interpreter loop above all), so each CPU keeps
 * the rows it found last in a direct-mapped cache, keyed by the table's
 * serial and the file address: one cache line instead of the search.  A
 * serial names one load of one table and is never given again, so rows
 * reloaded elsewhere (eviction, reset) are never found under an old key. */
#ifndef FLAMED_UW_ROW_CACHE
#define FLAMED_UW_ROW_CACHE 4096
#endif
#ifndef FLAMED_UW_MISS_NS
#define FLAMED_UW_MISS_NS 1000000000ULL
#endif

/* A process: its mappings with a table are uw_maps[slot * FLAMED_UW_MAPS ..
 * + n), sorted by start.  (Searched by map lookups, not by indexing an array
 * in the value: a search index used in pointer arithmetic must be tracked
 * precisely by the verifier, and every step of the search doubles the
 * states it explores.) */
struct flamed_uw_proc {
    __u32 slot;
    __u32 n;
};

/* An unwound stack: leaf first. */
struct flamed_ustack {
    __u32 len;
    __u32 end; /* FLAMED_UW_END_* */
    __u64 ip[FLAMED_UW_DEPTH];
};



/* The walk's registers and progress. */
struct flamed_uw_state {
    __u64 ip;
    __u64 sp;
    __u64 bp;
    __u64 hash;
    __u32 n;
    __u32 end;
    __u32 fp_frames;
    __u32 calls;
    __u32 miss;  /* an address without a table was met (outside every mapping, or in one with no rows) */
    __u32 pad;
    __u64 miss_addr; /* the first such address */
};

/* Per-CPU scratch: what crosses the tail calls of one sample (the sample's
 * key and generation, the walk, the stack being built). */
struct flamed_uw_scratch {
    struct flamed_ustack stack;
    struct flamed_uw_state s;
    struct flamed_key key;
    __u32 gen;
    __u32 is_watched;
    __u64 t0;
    __u64 wbase; /* address of the window's first byte; 0: none */
    __u32 wfailed; /* a copy failed in this walk: no more copies */
    __u32 wpad;
#if FLAMED_UW_WINDOW
    __u8 win[FLAMED_UW_WINDOW + 8];
#endif
};

#if FLAMED_UW_ROW_CACHE
struct flamed_uw_cached_row {
    __u64 key; /* serial << 32 | file address; 0: empty (serials start at 1) */
    struct flamed_uw_row row;
};
BPF_PERCPU_ARRAY(uw_row_cache, struct flamed_uw_cached_row, FLAMED_UW_ROW_CACHE);
#endif

/* Mappable: user space copies a binary's rows straight into the map's pages
 * (a memcpy), where a batch update costs the kernel ~0.2 us a row (a start
 * loads hundreds of thousands of rows). */
BPF_F_TABLE("array", int, struct flamed_uw_row, uw_rows, FLAMED_UW_ROWS, BPF_F_MMAPABLE);
BPF_HASH(uw_procs, u32, struct flamed_uw_proc, FLAMED_UW_MAX_PROCS);
BPF_ARRAY(uw_maps, struct flamed_uw_map, FLAMED_UW_MAX_PROCS * FLAMED_UW_MAPS);
BPF_PERCPU_ARRAY(uw_scratch, struct flamed_uw_scratch, 1);
BPF_HASH(ustacks0, u64, struct flamed_ustack, FLAMED_UW_STACK_ENTRIES);
BPF_HASH(ustacks1, u64, struct flamed_ustack, FLAMED_UW_STACK_ENTRIES);
/* 0: flamed_unwind, 1: flamed_finish (user space fills it before attaching). */
BPF_PROG_ARRAY(uw_progs, 2);
/* A process whose stack met an address without a table (a library loaded
 * since it was described, a large binary not loaded yet) is reported through
 * uw_miss with that address, at most once per FLAMED_UW_MISS_NS per process,
 * so user space reads its maps again and loads what the address needs. */
struct flamed_uw_miss {
    __u32 tgid;
    __u32 pad;
    __u64 addr;
};
BPF_TABLE("lru_hash", u32, u64, uw_missed, FLAMED_UW_MAX_PROCS);
BPF_PERF_OUTPUT(uw_miss);

/* The mapping holding pc, or NULL. */
static __always_inline struct flamed_uw_map *uw_find_map(struct flamed_uw_proc *p, u64 pc)
{
    u32 n = p->n;
    if (n > FLAMED_UW_MAPS)
        n = FLAMED_UW_MAPS;
    u32 base = p->slot * FLAMED_UW_MAPS;
    u32 lo = base, hi = base + n;
#pragma clang loop unroll(disable)
    for (u32 i = 0; i < 9; i++) {
        if (lo >= hi)
            break;
        u32 mid = (lo + hi) >> 1;
        struct flamed_uw_map *m = uw_maps.lookup(&mid);
        if (!m)
            return NULL;
        if (m->start <= pc)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == base)
        return NULL;
    u32 at = lo - 1;
    struct flamed_uw_map *m = uw_maps.lookup(&at);
    if (!m || pc >= m->end)
        return NULL;
    return m;
}

/* P[b] of m's page index (flamed.h), or 0xffffffff when it cannot be read. */
static __always_inline u32 uw_page(struct flamed_uw_map *m, u32 b)
{
    u32 at = m->index + (b >> 1);
    u32 *w = (u32 *)uw_rows.lookup(&at);
    if (!w)
        return 0xffffffff;
    return w[b & 1];
}

/* The row in effect at vaddr among m's rows: its kind, cfa8 and rbp; kind
 * FLAMED_UW_NONE when none is.  The page index narrows the binary search to
 * one bucket's rows (at most 1 << FLAMED_UW_PAGE_SHIFT of them: rows have
 * distinct addresses). */
static __always_inline void uw_find_row(struct flamed_uw_map *m, u64 vaddr, struct flamed_uw_row *out)
{
    out->kind = FLAMED_UW_NONE;
    if (vaddr > 0xffffffffULL || (u32)vaddr < m->base)
        return;
    u32 b = ((u32)vaddr - m->base) >> FLAMED_UW_PAGE_SHIFT;
    u32 pages = m->pages;
    u32 lo, hi;
    if (b >= pages) {
        /* Past the last bucket: the table's last row is in effect. */
        lo = uw_page(m, pages);
        hi = lo;
    } else {
        lo = uw_page(m, b);
        hi = uw_page(m, b + 1);
    }
    if (lo == 0xffffffff || hi == 0xffffffff || hi < lo)
        return;
    lo += m->first;
    hi += m->first;
    u32 first = m->first;
#pragma clang loop unroll(disable)
    for (u32 i = 0; i < FLAMED_UW_PAGE_SHIFT + 1; i++) {
        if (lo >= hi)
            break;
        u32 mid = (lo + hi) >> 1;
        struct flamed_uw_row *r = uw_rows.lookup(&mid);
        if (!r)
            return;
        if (r->pc <= (u32)vaddr)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == first)
        return;
    u32 at = lo - 1;
    struct flamed_uw_row *r = uw_rows.lookup(&at);
    if (r)
        *out = *r;
}

/* uw_find_row through this CPU's row cache. */
static __always_inline void uw_find_row_cached(struct flamed_uw_map *m, u64 vaddr, struct flamed_uw_row *out)
{
#if FLAMED_UW_ROW_CACHE
    if (vaddr <= 0xffffffffULL && m->serial) {
        u64 key = ((u64)m->serial << 32) | vaddr;
        u32 slot = (u32)((key * 0x9e3779b97f4a7c15ULL) >> 40) & (FLAMED_UW_ROW_CACHE - 1);
        struct flamed_uw_cached_row *c = uw_row_cache.lookup(&slot);
        if (c && c->key == key) {
            *out = c->row;
            return;
        }
        uw_find_row(m, vaddr, out);
        if (c) {
            c->row = *out;
            c->key = key;
        }
        return;
    }
#endif
    uw_find_row(m, vaddr, out);
}

#if FLAMED_UW_WINDOW
/* Does the window hold the 8 bytes at addr? */
static __always_inline int uw_in_window(struct flamed_uw_scratch *sc, u64 addr)
{
    return sc->wbase && addr >= sc->wbase && addr - sc->wbase <= FLAMED_UW_WINDOW - 8;
}
#endif

/* The 8 bytes of user stack at addr, from the window when it holds them
 * (see FLAMED_UW_WINDOW); 0 on success, as bpf_probe_read_user. */
static __always_inline int uw_read8(struct flamed_uw_scratch *sc, u64 addr, u64 *out)
{
#if FLAMED_UW_WINDOW
    if (!uw_in_window(sc, addr) && !sc->wfailed) {
        /* From a little below: a frame's saved rbp lies under its return address. */
        u64 base = addr >= 64 ? addr - 64 : addr;
        if (bpf_probe_read_user(sc->win, FLAMED_UW_WINDOW, (void *)base) == 0) {
            sc->wbase = base;
        } else {
            sc->wbase = 0;
            sc->wfailed = 1;
        }
    }
    if (uw_in_window(sc, addr)) {
        __builtin_memcpy(out, sc->win + ((addr - sc->wbase) & (FLAMED_UW_WINDOW - 1)), 8);
        return 0;
    }
#endif
    return bpf_probe_read_user(out, 8, (void *)addr);
}

/* Record the frame at s->ip, then move s to its caller: 1 to go on, 0 when
 * the walk ended (s->end says why). */
static __always_inline int uw_step(struct flamed_uw_scratch *sc, struct flamed_uw_proc *p,
                                   struct flamed_uw_state *s, struct flamed_ustack *st)
{
    u32 n = s->n;
    if (n >= FLAMED_UW_DEPTH) {
        s->end = FLAMED_UW_END_DEPTH;
        return 0;
    }
    st->ip[n & 127] = s->ip;
    /* The leaf is not part of the stack's identity (struct flamed_key's
     * native_leaf carries it). */
    if (n)
        s->hash = flamed_mix(s->hash, s->ip);
    s->n = n + 1;

    /* A caller's address is a return address: the call is the byte before. */
    u64 pc = n ? s->ip - 1 : s->ip;
    struct flamed_uw_row row = {};
    struct flamed_uw_map *m = uw_find_map(p, pc);
    u64 vaddr = 0;
    if (m && m->pages) {
        vaddr = pc - m->bias;
        uw_find_row_cached(m, vaddr, &row);
    } else if (pc < 0x800000000000ULL && !s->miss) {
        /* A library loaded since the process was described, or a large
         * binary whose rows user space loads only once a sample needs them. */
        s->miss = 1;
        s->miss_addr = pc;
    }
    u64 cfa;
    u64 ra = 0;
    u64 bp = s->bp;
    switch (row.kind) {
    case FLAMED_UW_STOP:
        s->end = FLAMED_UW_END_COMPLETE;
        return 0;
    case FLAMED_UW_CFA_RSP:
        cfa = s->sp + ((u64)row.cfa8 << 3);
        break;
    case FLAMED_UW_CFA_RBP:
        cfa = s->bp + ((u64)row.cfa8 << 3);
        break;
    case FLAMED_UW_PLT:
        cfa = s->sp + ((u64)row.cfa8 << 3) + ((((s->ip - m->bias) & 15) >= (u64)row.rbp) ? 8 : 0);
        row.rbp = 0;
        break;
    case FLAMED_UW_NONE:
        /* CPython's perf trampolines (3.12+, run with -X perf or
         * PYTHONPERFSUPPORT=1): copies of `sub $8,%rsp; call *%rcx;
         * add $8,%rsp; ret` in an anonymous mapping, with no table and no
         * frame pointer.  A return address there is the `add` right after
         * the `call`: the frame is 16 bytes (the 8 subtracted and the
         * return address) and rbp is the caller's. */
        if (n && !m) {
            u64 code = 0;
            if (bpf_probe_read_user(&code, 8, (void *)(s->ip - 2)) == 0
                && (code & 0x00FFFFFFFFFFFFFFULL) == 0x00C308C48348D1FFULL) {
                cfa = s->sp + 16;
                break;
            }
        }
        /* The frame pointer chain: [rbp] = caller's rbp, [rbp + 8] = return
         * address.  It ends at rbp == 0 (set by _start and the thread entry)
         * only in code of a binary without tables (JIT code, a binary built
         * without CFI), whose frames are all chained so.  In a binary with
         * tables (a routine without CFI, or a large table not loaded yet) the
         * outermost frame has a stop row: there rbp == 0 is a register used
         * for something else, and the callers are unknown. */
        if (!s->bp) {
            s->end = (n && !m) ? FLAMED_UW_END_COMPLETE : FLAMED_UW_END_NO_TABLE;
            return 0;
        }
        cfa = s->bp + 16;
        if (uw_read8(sc, s->bp, &bp) != 0) {
            s->end = FLAMED_UW_END_NO_TABLE;
            return 0;
        }
        s->fp_frames++;
        break;
    default:
        s->end = FLAMED_UW_END_UNSUPPORTED;
        return 0;
    }
    if (uw_read8(sc, cfa - 8, &ra) != 0) {
        s->end = row.kind == FLAMED_UW_NONE ? FLAMED_UW_END_NO_TABLE : FLAMED_UW_END_READ_FAULT;
        return 0;
    }
    if (row.kind != FLAMED_UW_NONE && row.rbp != 0) {
        if (uw_read8(sc, cfa - (u64)row.rbp * 8, &bp) != 0) {
            s->end = FLAMED_UW_END_READ_FAULT;
            return 0;
        }
    }
    if (cfa <= s->sp) {
        /* The stack grows down: a caller's frame is above its callee's. */
        s->end = row.kind == FLAMED_UW_NONE ? FLAMED_UW_END_NO_TABLE : FLAMED_UW_END_READ_FAULT;
        return 0;
    }
    if (!ra) {
        s->end = FLAMED_UW_END_COMPLETE;
        return 0;
    }
    s->ip = ra;
    s->sp = cfa;
    s->bp = bp;
    return 1;
}

/* The registers of the interrupted user context; 0 when there is none. */
static __always_inline int uw_user_regs(struct bpf_perf_event_data *ctx, struct flamed_uw_state *s)
{
    if (in_user_mode(ctx)) {
        s->ip = PT_REGS_IP(&ctx->regs);
        s->sp = PT_REGS_SP(&ctx->regs);
        s->bp = PT_REGS_FP(&ctx->regs);
        return 1;
    }
    /* In the kernel on behalf of the task: its user registers are saved at
     * the top of its kernel stack. */
    struct task_struct *task = (struct task_struct *)bpf_get_current_task_btf();
    struct pt_regs *r = (struct pt_regs *)bpf_task_pt_regs(task);
    struct pt_regs u = {};
    if (!r || bpf_probe_read_kernel(&u, sizeof(u), r) != 0)
        return 0;
    s->ip = PT_REGS_IP(&u);
    s->sp = PT_REGS_SP(&u);
    s->bp = PT_REGS_FP(&u);
    return s->ip != 0 && s->sp != 0;
}

/* Called by flamed_sample inside its in-flight section: for a process with
 * tables, hand the sample to flamed_unwind (which does not come back).
 * Returns when the process has none, or the tail call failed (then the
 * sample keeps its frame-pointer stack). */
static __always_inline void uw_begin(struct bpf_perf_event_data *ctx, u32 gen, struct flamed_key *key,
                                     int is_watched)
{
    u32 tgid = key->tgid;
    if (!uw_procs.lookup(&tgid))
        return;
    u32 zero = 0;
    struct flamed_uw_scratch *sc = uw_scratch.lookup(&zero);
    if (!sc)
        return;
#if FLAMED_UW_TIMING
    sc->t0 = bpf_ktime_get_ns();
#endif
    struct flamed_uw_state *s = &sc->s;
    s->n = 0;
    s->end = FLAMED_UW_END_DEPTH;
    s->fp_frames = 0;
    s->calls = 0;
    s->miss = 0;
    s->miss_addr = 0;
    s->hash = 0xcbf29ce484222325ULL ^ tgid;
    sc->wbase = 0;
    sc->wfailed = 0;
    if (!uw_user_regs(ctx, s))
        return;
    __builtin_memcpy(&sc->key, key, sizeof(*key));
    sc->gen = gen;
    sc->is_watched = is_watched;
    stat_inc(gen, FLAMED_STAT_UW_SAMPLES);
    uw_progs.call(ctx, 0);
    stat_inc(gen, FLAMED_STAT_UW_TAIL_FAILED);
}

/* Count how the walk ended and store the stack in the generation's
 * ustacks; its id, 0 when the map was full. */
static __always_inline u64 uw_store(struct flamed_uw_scratch *sc, u32 gen)
{
    struct flamed_uw_state *s = &sc->s;
    switch (s->end) {
    case FLAMED_UW_END_COMPLETE:
        stat_inc(gen, FLAMED_STAT_UW_COMPLETE);
        break;
    case FLAMED_UW_END_NO_TABLE:
        stat_inc(gen, FLAMED_STAT_UW_NO_TABLE);
        break;
    case FLAMED_UW_END_UNSUPPORTED:
        stat_inc(gen, FLAMED_STAT_UW_UNSUPPORTED);
        break;
    case FLAMED_UW_END_DEPTH:
        stat_inc(gen, FLAMED_STAT_UW_DEPTH);
        break;
    default:
        stat_inc(gen, FLAMED_STAT_UW_READ_FAULT);
        break;
    }
    if (s->fp_frames) {
        u32 idx = gen * FLAMED_NSTATS + FLAMED_STAT_UW_FP_FRAMES;
        u64 *v = stats.lookup(&idx);
        if (v)
            *v += s->fp_frames;
    }
    struct flamed_ustack *st = &sc->stack;
    st->len = s->n;
    st->end = s->end;
    /* The leaf goes into the count key; the stored stack is the callers'. */
    sc->key.native_leaf = s->n ? st->ip[0] : 0;
    st->ip[0] = 0;
    u64 id = flamed_mix(s->hash, s->n ^ ((u64)s->end << 32));
    if (id == 0)
        id = 1;
    void *found = gen ? ustacks1.lookup(&id) : ustacks0.lookup(&id);
    if (!found) {
        int err = gen ? ustacks1.insert(&id, st) : ustacks0.insert(&id, st);
        if (err != 0 && err != -FLAMED_EEXIST) {
            stat_inc(gen, FLAMED_STAT_UW_STACKS_FULL);
            sc->key.native_leaf = 0;
            return 0;
        }
    }
    return id;
}

/* Close the in-flight section flamed_sample opened. */
static __always_inline void uw_close_section(void)
{
    u32 zero = 0;
    u64 *seq = inflight.lookup(&zero);
    if (seq)
        __sync_fetch_and_add(seq, 1);
}

int flamed_unwind(struct bpf_perf_event_data *ctx)
{
    u32 zero = 0;
    struct flamed_uw_scratch *sc = uw_scratch.lookup(&zero);
    if (!sc)
        return 0; /* cannot happen: the array has its one element */
    u32 gen = sc->gen & 1;
    u32 tgid = sc->key.tgid;
    struct flamed_uw_proc *p = uw_procs.lookup(&tgid);
    int more = 0;
    if (p) {
        more = 1;
#pragma clang loop unroll(disable)
        for (u32 i = 0; i < FLAMED_UW_FRAMES_PER_CALL; i++) {
            if (!uw_step(sc, p, &sc->s, &sc->stack)) {
                more = 0;
                break;
            }
        }
    } else {
        sc->s.end = FLAMED_UW_END_READ_FAULT; /* forgotten meanwhile */
    }
    if (more) {
        sc->s.calls++;
        uw_progs.call(ctx, 0);
        /* The kernel's limit of tail calls per sample. */
        sc->s.end = FLAMED_UW_END_DEPTH;
    }
    /* 0 (ustacks full): flamed_finish takes the frame-pointer stack instead. */
    sc->key.native_stack_id = uw_store(sc, gen);
    if (sc->s.miss) {
        u64 now = bpf_ktime_get_ns();
        u64 *last = uw_missed.lookup(&tgid);
        if (!last || now - *last >= FLAMED_UW_MISS_NS) {
            uw_missed.update(&tgid, &now);
            struct flamed_uw_miss e = {};
            e.tgid = tgid;
            e.addr = sc->s.miss_addr;
            uw_miss.perf_submit(ctx, &e, sizeof(e));
        }
    }
#if FLAMED_UW_TIMING
    u32 idx = gen * FLAMED_NSTATS + FLAMED_STAT_UW_NS;
    u64 *v = stats.lookup(&idx);
    if (v)
        *v += bpf_ktime_get_ns() - sc->t0;
#endif
    uw_progs.call(ctx, 1);
    /* flamed_finish is missing: the sample cannot be counted. */
    stat_inc(gen, FLAMED_STAT_UW_TAIL_FAILED);
    uw_close_section();
    return 0;
}

int flamed_finish(struct bpf_perf_event_data *ctx)
{
    u32 zero = 0;
    struct flamed_uw_scratch *sc = uw_scratch.lookup(&zero);
    if (!sc)
        return 0;
    struct flamed_key key = {};
    __builtin_memcpy(&key, &sc->key, sizeof(key));
    finish_sample(ctx, &key, sc->gen & 1, sc->is_watched != 0);
    return 0;
}
