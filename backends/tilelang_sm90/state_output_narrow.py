"""The state pass fused with the output, warp-specialized by hand: three warpgroups per program.

    producer  (threads   0-127)  TMA: Q, K, Tb, V and gamma of chunk i into stage i % STAGES
    state     (threads 128-255)  the serial chain, per chunk:
                                   S -> bf16 S -> K S -> X = V - diag(Gamma) K S -> U = Tb X
                                   -> S' = Gamma_C S + K^T diag(Gamma_C / Gamma) U
    output    (threads 256-383)  O = scale ( diag(Gamma) Q S + (Q K^T (.) D_incl) U ), stored
                                 (emit_output=False: only each chunk's S0, stored to hs)

U = Tb (V - diag(Gamma) K S) is the chunk's new values: with Tb = T diag(beta) from intra_chunk.py it equals
U' - W S (U' = Tb V, W = Tb diag(Gamma) K), so W and U' never go through global memory. A chunk costs one
more product on the chain (Tb X, 64 x 64 x BV) and reads 8 KB of Tb and BV columns of V instead of 16 KB of
W and BV columns of U'.

The state warpgroup hands the output warpgroup each chunk's bf16 S (before the update) and U through
double-buffered shared tiles, so chunk i's output runs while the state chain already works on chunk
i + 1. In state_output_pipelined.py the output gemms and stores run in series with the chain (that kernel stays for
128-wide V tiles, which do not fit here in shared memory).

Barriers (slot s = i % STAGES for the loads, i % 2 for the hand-over; phase parity = (i // slots) % 2):
    loaded[s]    producer -> both consumers: stage s holds chunk i (TMA bytes + 128 producer arrivals)
    freed[s]     both consumers -> producer: stage s may be overwritten (256 arrivals; the recompute's: the state
                 role's 128, and the store role's where X is made in the stage, per_sm=2)
    su_ready[s]  state -> output: s_s[s] and u_s[s] hold chunk i's S and U (128 arrivals)
    su_free[s]   output -> state: s_s[s] and u_s[s] may be overwritten (128 arrivals)
A wait for a "free" barrier uses the flipped parity, so the first round passes at once.

chained (context parallelism's chained route, forward.py): the programs run over segments, and each first walks
back walk[n, hv] chunks before its segment, state only (no Q loads, no output, no hand-over, no S0 stores), from
a zero state -- as many chunks as the decay bound needs for that head (lead_in.walk_lengths), so the state at the
segment's start is within e^-12 of the true one -- or from the sequence's h0 where the walk reaches the
sequence's start (walk == before[n]: exact). A segment costs its own chunks plus its longest head's walk, never
more than the sequence without segments, and needs nothing from another program (no flags between CTAs, so no
co-residency or launch-order assumption). h0 is per segment: its sequence's initial state.

Same grid and contract as state_output_pipelined.py (forward.py picks one by V tile), so the signature repeats that
kernel's (TileLang prim_func signatures cannot be shared) and the per-program bounds come from its
`sequence_bounds`. Tail chunks and the TMA boxes past a sequence's end
behave as there too: X's rows and Q K^T's rows go through selects on `t < n_valid` (Tb's columns past
n_valid are zero, its rows there are never read: U's rows go through the same select), and only the stores
write rows below n_valid.
"""
import tilelang
import tilelang.language as T

from .sequence_macros import sequence_bounds, walked_run

CHUNK = 64
THREADS = 384
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
                # the roles and barriers are written out here: TileLang's own pipeliner must stay out
                tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}


def state_output_narrow_program(H: int, HV: int, dtype: str = "bfloat16", has_initial_state: bool = False,
                                store_final_state: bool = False, block_v: int = 64, stages: int = 3,
                                store_states: bool = False, emit_output: bool = True, chained: bool = False,
                                store_x: bool = False, per_sm: int = 1, K: int = 128, V: int = 128):
    """store_states (training): also write every chunk's entering state S0 in bf16 to `hs` [num_chunks, HV, K,
    V] (the output warpgroup stores the hand-over tile it reads anyway, off the state chain); otherwise `hs`
    is a 1-element placeholder the kernel never touches.
    emit_output=False (the backward's recompute of S0, with store_states): no O, so no Q loads, no U hand-over
    and no output products; the third warpgroup only stores S0, and `o` is a 1-element placeholder.
    store_x (with store_states, without output: the recompute for the fused backward): each chunk's X = V -
    diag(Gamma) K S0 also leaves, in the inputs' dtype, into `o` [1, num_tokens, HV, V] (rows past a sequence's end
    untouched), where the fused backward reads it instead of making it again (backward_fused.py; the caller passes
    dV's buffer, which that kernel overwrites chunk by chunk after reading X).
    chained: `walk` [num_walk >= num_seqs, HV] and `before` [num_walk] int32 are read (module docstring);
    otherwise they are placeholders the kernel never touches.
    per_sm=2 (store_x only, 2 stages): two programs share an SM (`__launch_bounds__(384, 2)`: 80 registers a
    thread at launch, the state role raising itself to 192 while the other two drop to 24; 107008 bytes of shared
    memory against 123392), so one program's chain runs while the other's waits. X is made in place in V's stage
    tile (V's only reader is X's own pass) instead of a hand-over slot of its own, so the stage is freed by the
    store role too, once its TMA stores of S0 and X (one wait for both) have read their tiles."""
    C = CHUNK
    BV = block_v     # <= 64: three stages of Q/K/Tb/V (48 KB each at 64) plus the hand-over tiles fit ~217 KB
    NV = V // BV
    accum = "float32"
    assert HV % H == 0 and K == 128 and V == 128 and BV in (32, 64) and stages in (2, 3)
    assert emit_output or store_states, "a pass that writes neither O nor S0"
    assert not store_x or (store_states and not emit_output), "X leaves only beside S0, through o's argument"
    assert per_sm == 1 or (per_sm == 2 and store_x and stages == 2), "two an SM: the recompute with X, 2 stages"
    SLOTS = 2                                          # S/U hand-over slots
    # setmaxnreg budgets (producer, state, the third role): at one program an SM 65536 / 384 = 168 at launch
    # rebalanced, at two 80 (ptxas' cap for 768 threads), 128 x (24 + 192 + 24) = 384 x 80
    PRODUCER_REGS, CONSUMER_REGS, THIRD_REGS = (40, 232, 232) if per_sm == 1 else (24, 192, 24)
    GROUP = HV // H

    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_seqs = T.dynamic("num_seqs")
    num_h0 = T.dynamic("num_h0")
    num_ht = T.dynamic("num_ht")
    num_walk = T.dynamic("num_walk")
    HS_SHAPE = (num_chunks, HV, K, V) if store_states else (1, 1, 1, 1)
    O_SHAPE = (1, num_tokens, HV, V) if emit_output or store_x else (1, 1, 1, 1)

    @T.macro
    def release_walked(pre, loaded, freed):
        """The walk's chunks in a role that reads none of them: only release their stages (freed counts it)."""
        for i in T.serial(pre):
            s = i % stages
            T.barrier_wait(loaded[s], (i // stages) % 2)
            T.barrier_arrive(freed[s])

    @T.macro
    def store_rows(tiles, slot, o, t0, n_valid, hv, v0):
        """A tail chunk's valid rows by the threads, from tiles[slot]: a TMA box would overwrite the next
        sequence's."""
        for r, j in T.Parallel(C, BV):
            if r < n_valid:
                o[0, t0 + r, hv, v0 + j] = tiles[slot, r, j]

    @T.prim_func
    def gdn_state_output_narrow(
        q: T.Tensor((1, num_tokens, H, K), dtype),
        k: T.Tensor((1, num_tokens, H, K), dtype),
        a: T.Tensor((1, num_tokens, HV, C), dtype),
        v: T.Tensor((1, num_tokens, HV, V), dtype),
        gamma: T.Tensor((HV, num_chunks, C), accum),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        chunk_offsets: T.Tensor((num_seqs + 1,), "int32"),
        h0: T.Tensor((num_h0, HV, K, V), accum),
        o: T.Tensor(O_SHAPE, dtype),
        ht: T.Tensor((num_ht, HV, K, V), accum),
        scale: T.float32,
        hs: T.Tensor(HS_SHAPE, dtype),
        walk: T.Tensor((num_walk, HV), "int32"),
        before: T.Tensor((num_walk,), "int32"),
    ):
        with T.Kernel(NV, HV, num_seqs, threads=THREADS) as (bv, hv, n):
            if per_sm > 1:
                T.annotate_min_blocks_per_sm(per_sm)
            hk = hv // GROUP
            v0 = bv * BV
            bos, eos, n_chunks, c0 = sequence_bounds(cu_seqlens, chunk_offsets, n)
            # the run: `pre` chunks walked back (chained), then the program's own n_chunks; chunk i of the run is
            # its own i - pre
            pre, exact, bos_run, c0_run = walked_run(walk, before, n, hv, bos, c0, chained)

            # stage tiles (TMA destinations)
            if emit_output:
                q_s = T.alloc_shared((stages, C, K), dtype)
            k_s = T.alloc_shared((stages, C, K), dtype)
            a_s = T.alloc_shared((stages, C, C), dtype)
            v_s = T.alloc_shared((stages, C, BV), dtype)
            g_s = T.alloc_shared((stages, C), accum)
            # state -> output hand-over
            s_s = T.alloc_shared((SLOTS, K, BV), dtype)
            if emit_output:
                u_s = T.alloc_shared((SLOTS, C, BV), dtype)
                o_s = T.alloc_shared((C, BV), dtype)  # output: O of a full chunk, the source of its TMA store
            x_in_stage = per_sm == 2   # (store_x, asserted above) X in V's stage tile, freed by the store role too
            if store_x and not x_in_stage:
                xh_s = T.alloc_shared((SLOTS, C, BV), dtype)   # X: state -> the S0 store's warpgroup, beside S
            # private to the state role
            x_s = T.alloc_shared((C, BV), dtype)      # X = V - diag(Gamma) K S (where not handed over), then
                                                      # diag(Gamma_C / Gamma) U

            S = T.alloc_fragment((K, BV), accum)
            x = T.alloc_fragment((C, BV), accum)      # K S, X, then U
            if emit_output:
                acc_o = T.alloc_fragment((C, BV), accum)
                qk = T.alloc_fragment((C, C), accum)
                p = T.alloc_fragment((C, C), dtype)   # Q K^T (.) D_incl in bf16: the register operand of P U
            # per-row decays, one exp per row instead of one per element (a thread holds 2 rows of a 64-row
            # accumulator, so the element-wise form spent 32 exps per thread where 2 do)
            e_x = T.alloc_fragment((C,), accum)       # state: Gamma, the rows of K S
            e_u = T.alloc_fragment((C,), accum)       # state: Gamma_C / Gamma, the rows of U
            if emit_output:
                e_o = T.alloc_fragment((C,), accum)   # output: Gamma, the rows of Q S
            g_last = T.alloc_var(accum)

            loaded = T.alloc_barrier(arrive_count=[128] * stages)
            # the stage's readers: the state warpgroup, and the output warpgroup where there is output, or the
            # store role where X is made in the stage
            freed = T.alloc_barrier(arrive_count=[256 if emit_output or x_in_stage else 128] * stages)
            su_ready = T.alloc_barrier(arrive_count=[128] * SLOTS)
            su_free = T.alloc_barrier(arrive_count=[128] * SLOTS)

            tx = T.get_thread_binding()
            if tx < 128:
                # ---- producer ----
                T.set_max_nreg(PRODUCER_REGS, 0)
                for i in T.serial(pre + n_chunks):
                    s = i % stages
                    T.barrier_wait(freed[s], ((i // stages) % 2) ^ 1)
                    t0 = bos_run + i * C
                    if emit_output:
                        if i >= pre:  # Q only for the program's own chunks
                            T.tma_copy(q[0, t0:t0 + C, hk, 0:K], q_s[s, :, :], barrier=loaded[s])
                    T.tma_copy(k[0, t0:t0 + C, hk, 0:K], k_s[s, :, :], barrier=loaded[s])
                    T.tma_copy(a[0, t0:t0 + C, hv, 0:C], a_s[s, :, :], barrier=loaded[s])
                    T.tma_copy(v[0, t0:t0 + C, hv, v0:v0 + BV], v_s[s, :, :], barrier=loaded[s])
                    T.tma_copy(gamma[hv, c0_run + i, 0:C], g_s[s, :], barrier=loaded[s])
                    T.barrier_arrive(loaded[s])
            elif tx < 256:
                # ---- state chain ----
                T.set_max_nreg(CONSUMER_REGS, 1)
                if has_initial_state and exact:  # exact: a chained walk reaching the sequence's boundary, else always
                    T.copy(h0[n, hv, 0:K, v0:v0 + BV], S)
                else:
                    T.clear(S)
                for i in T.serial(pre + n_chunks):
                    s = i % stages
                    own = T.max(i - pre, 0)  # the walk's chunks use slot 0 unsignalled: the output has not begun
                    h = own % SLOTS
                    n_valid = T.min(eos - bos_run - i * C, C)
                    T.barrier_wait(loaded[s], (i // stages) % 2)
                    if i >= pre:
                        T.barrier_wait(su_free[h], ((own // SLOTS) % 2) ^ 1)
                    T.copy(S, s_s[h, :, :])
                    T.fence_proxy_async()
                    T.wgmma_gemm(k_s[s, :, :], s_s[h, :, :], x, clear_accum=True)     # K S
                    g_last = g_s[s, n_valid - 1]
                    for r in T.Parallel(C):
                        e_x[r] = T.exp(g_s[s, r])
                        e_u[r] = T.exp(g_last - g_s[s, r])
                    T.wait_wgmma(0)
                    if x_in_stage:   # each thread overwrites the elements of V it has just read
                        for r, j in T.Parallel(C, BV):
                            v_s[s, r, j] = T.if_then_else(r < n_valid, v_s[s, r, j] - x[r, j] * e_x[r], 0.0)
                        T.fence_proxy_async()
                        T.wgmma_gemm(a_s[s, :, :], v_s[s, :, :], x, clear_accum=True)    # U = Tb X
                    else:
                        for r, j in T.Parallel(C, BV):
                            x[r, j] = T.if_then_else(r < n_valid, v_s[s, r, j] - x[r, j] * e_x[r], 0.0)
                        if store_x:  # in the hand-over slot, which the product reads as well (no extra copy)
                            T.copy(x, xh_s[h, :, :])
                            T.fence_proxy_async()
                            T.wgmma_gemm(a_s[s, :, :], xh_s[h, :, :], x, clear_accum=True)    # U = Tb X
                        else:
                            T.copy(x, x_s)
                            T.fence_proxy_async()
                            T.wgmma_gemm(a_s[s, :, :], x_s, x, clear_accum=True)               # U = Tb X
                    T.wait_wgmma(0)
                    for r, j in T.Parallel(C, BV):
                        x[r, j] = T.if_then_else(r < n_valid, x[r, j], 0.0)
                    if emit_output:
                        if i >= pre:
                            T.copy(x, u_s[h, :, :])
                    for r, j in T.Parallel(C, BV):
                        x_s[r, j] = x[r, j] * e_u[r]
                    T.fence_proxy_async()
                    if i >= pre:
                        T.barrier_arrive(su_ready[h])
                    for r, j in T.Parallel(K, BV):
                        S[r, j] = S[r, j] * T.exp(g_last)
                    T.wgmma_gemm(k_s[s, :, :], x_s, S, transpose_A=True)               # += K^T U_d
                    T.wait_wgmma(0)
                    T.barrier_arrive(freed[s])
                if store_final_state:
                    T.copy(S, ht[n, hv, 0:K, v0:v0 + BV])
            elif not emit_output:
                # ---- S0 only (the backward's recompute): the hand-over tile to hs ----
                T.set_max_nreg(THIRD_REGS, 1 if per_sm == 1 else 0)
                if x_in_stage:
                    release_walked(pre, loaded, freed)
                    for i in T.serial(n_chunks):
                        s = (pre + i) % stages
                        h = i % SLOTS
                        t0 = bos + i * C
                        n_valid = T.min(eos - t0, C)
                        # past su_ready, chunk i's stage has loaded, so this arrival on freed counts toward its use
                        T.barrier_wait(su_ready[h], (i // SLOTS) % 2)
                        T.tma_copy(s_s[h, :, :], hs[c0 + i, hv, 0:K, v0:v0 + BV])   # TMA stores, waited for below
                        if n_valid == C:
                            T.tma_copy(v_s[s, :, :], o[0, t0:t0 + C, hv, v0:v0 + BV])
                        else:
                            store_rows(v_s, s, o, t0, n_valid, hv, v0)
                        T.tma_store_wait(0)   # both stores' reads of their tiles, by the thread that issued them
                        T.barrier_arrive(su_free[h])
                        T.barrier_arrive(freed[s])
                else:
                    for i in T.serial(n_chunks):  # own chunks only: the walk's are another program's
                        h = i % SLOTS
                        T.barrier_wait(su_ready[h], (i // SLOTS) % 2)
                        T.copy(s_s[h, :, :], hs[c0 + i, hv, 0:K, v0:v0 + BV])
                        if store_x:  # as O's stores: a full chunk by TMA, a tail's valid rows by threads
                            t0 = bos + i * C
                            n_valid = T.min(eos - t0, C)
                            if n_valid == C:
                                T.copy(xh_s[h, :, :], o[0, t0:t0 + C, hv, v0:v0 + BV])
                            else:
                                store_rows(xh_s, h, o, t0, n_valid, hv, v0)
                        T.barrier_arrive(su_free[h])
            else:
                # ---- output ----
                T.set_max_nreg(CONSUMER_REGS, 1)
                release_walked(pre, loaded, freed)
                for i in T.serial(n_chunks):
                    s = (pre + i) % stages
                    h = i % SLOTS
                    t0 = bos + i * C
                    n_valid = T.min(eos - t0, C)
                    T.barrier_wait(loaded[s], ((pre + i) // stages) % 2)
                    T.wgmma_gemm(q_s[s, :, :], k_s[s, :, :], qk, transpose_B=True, clear_accum=True)  # Q K^T
                    T.barrier_wait(su_ready[h], (i // SLOTS) % 2)
                    T.wgmma_gemm(q_s[s, :, :], s_s[h, :, :], acc_o, clear_accum=True)                 # Q S
                    for r in T.Parallel(C):
                        e_o[r] = T.exp(g_s[s, r])
                    T.wait_wgmma(0)
                    for r, c in T.Parallel(C, C):
                        qk[r, c] = T.if_then_else(r >= c, T.if_then_else(r < n_valid, qk[r, c] * T.exp(g_s[s, r] - g_s[s, c]), 0.0), 0.0)
                    T.copy(qk, p)
                    for r, j in T.Parallel(C, BV):
                        acc_o[r, j] = acc_o[r, j] * e_o[r]
                    T.fence_proxy_async()
                    T.wgmma_gemm(p, u_s[h, :, :], acc_o)                                                # += P U
                    T.wait_wgmma(0)
                    if store_states:
                        T.copy(s_s[h, :, :], hs[c0 + i, hv, 0:K, v0:v0 + BV])
                    T.barrier_arrive(su_free[h])
                    T.barrier_arrive(freed[s])
                    # full chunks: whole 128-byte lines through one TMA store; a tail chunk stores its valid
                    # rows only, a TMA box would overwrite the next sequence's
                    full = n_valid == C
                    if full:
                        for r, j in T.Parallel(C, BV):
                            o_s[r, j] = acc_o[r, j] * scale
                        T.copy(o_s, o[0, t0:t0 + C, hv, v0:v0 + BV])
                    else:
                        for r, j in T.Parallel(C, BV):
                            if r < n_valid:
                                o[0, t0 + r, hv, v0 + j] = acc_o[r, j] * scale

    return gdn_state_output_narrow
