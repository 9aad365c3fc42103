"""The state pass fused with the output at the full V = 128 columns, split by product (docs/sm90-design.md): three
warpgroups per (sequence or segment, value head), one program each, with the chain cut to two products a chunk.

The chunk's new values U = Tb (V - diag(Gamma) K S) are written as U = U' - W S with U' = Tb V and
W = (Tb diag(Gamma)) K: both are independent of S, so they are made for chunk i + 1 while chunk i's chain runs,
and the serial chain per chunk is W S -> U -> K_d^T U (K_d = diag(Gamma_C / Gamma) K) -> S, two 128-deep products
and one hand-over each way, where the Tb form needs three products and two elementwise passes in series
(H200 clock64 trace: ~6200 clocks a chunk, of which x's K S -> X -> Tb X -> U, U_d took ~4200).

    owner    (threads   0-127)  S [K, V] fp32 in registers. Per chunk, while x works: S <- Gamma_C S and
                                K_d into shared memory; then S += K_d^T U; hands the next chunk its bf16 S
    x        (threads 128-255)  U = U' - W S (U' in its accumulator from the step before), masked to the
                                chunk's rows; hands U over; then chunk i + 1's W (kept negated in registers,
                                the A operand of W S) and U'
    output   (threads 256-383)  O = scale (diag(Gamma) Q S + (Q K^T (.) D_incl) U); a full chunk's O leaves by
                                TMA store staged in U's slot. And the loads: TMA of Q, K, Tb, V and gamma of
                                chunk i + STAGES into stage i % STAGES once the three roles are done with chunk
                                i there (it reads each stage last, and its work is off the chain)

Against state_output_narrow.py (one state warpgroup per 64 columns, two programs per head): each product is issued
once at full width, and Q, K and Tb are loaded once per head and chunk instead of twice (56 KB a chunk instead
of 96), which is what limits 128 programs of the 64-column kernel together (~3.8 TB/s, docs/performance.md).

Registers: ptxas caps every role's code at 65536 / threads (168 at 384 threads; setmaxnreg only moves registers
at run time), which is why there is no producer warpgroup: a fourth would cap the owner, whose S alone is 128
registers a thread, at 128. x holds one [64, 128] accumulator (W, then U', then U) and -W in bf16 (32 more).
Shared memory (bytes): 2 stages x (Q 16K + K 16K + Tb 8K + V 16K + gamma 256) = 115200; bf16 S, one slot (read
by x's W S and the output's Q S; the owner writes the next S once both are done) 32768; U, two slots (read by
the owner and the output, then O's staging) 32768; Tb diag(Gamma) 8192; K_d 16384; the gammas' two exponential
vectors 512: 205824.

Barriers (stage slot s = i % STAGES, U slot h = i % 2; parity (i // slots) % 2, flipped for "free"):
    loaded[s]   output's TMA -> all three roles         freed[s]   owner, x, output -> the output's next load (384)
    s_ready     owner -> x, output: S of chunk i         s_free     x, output -> owner (256)
    u_ready[h]  x -> owner, output: U of chunk i         u_free[h]  output -> x (after O's store left the slot)
The output waits freed[s] (the owner's K_d^T U done) before it stages O over U.

forward.py takes it for passes without S0 stores whose (sequence or segment, head) programs fill 70% of the SMs
(plan.state_block_v), and for the wide route's segments (plan.wide_segment_chunks); the
pipelined state_output_pipelined.py keeps the training builds that store S0. The chained build walks back before each
segment as state_output_narrow.py's does; the walk's chunks have no output.
"""
import tilelang
import tilelang.language as T

from .sequence_macros import sequence_bounds, walked_run

CHUNK = 64
THREADS = 384
STAGES = 2
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
                tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}


def state_output_wide_program(H: int, HV: int, dtype: str = "bfloat16", has_initial_state: bool = False,
                              store_final_state: bool = False, chained: bool = False, K: int = 128, V: int = 128):
    """The TileLang prim_func (symbolic token, sequence and chunk counts; `scale` a runtime argument). chained: the
    programs run over segments and first walk back walk[n, hv] chunks, state only, as state_output_narrow.py's
    chained build does (from h0 where walk == before[n], else from zero); unchained builds never read walk /
    before."""
    C = CHUNK
    accum = "float32"
    assert HV % H == 0 and K == 128 and V == 128
    GROUP = HV // H

    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_seqs = T.dynamic("num_seqs")
    num_h0 = T.dynamic("num_h0")
    num_ht = T.dynamic("num_ht")
    num_walk = T.dynamic("num_walk")

    @T.macro
    def load(q, k, a, v, gamma, q_s, k_s, a_s, v_s, g_s, loaded, bos, c0, hk, hv, i, s, with_q):
        """TMA of the run's chunk i: K, Tb, V and gamma, and Q where with_q, into stage s (the output warpgroup's
        128 threads arrive)."""
        t0 = bos + i * C
        if with_q:
            T.tma_copy(q[0, t0:t0 + C, hk, 0:K], q_s[s, :, :], barrier=loaded[s])
        T.tma_copy(k[0, t0:t0 + C, hk, 0:K], k_s[s, :, :], barrier=loaded[s])
        T.tma_copy(a[0, t0:t0 + C, hv, 0:C], a_s[s, :, :], barrier=loaded[s])
        T.tma_copy(v[0, t0:t0 + C, hv, 0:V], v_s[s, :, :], barrier=loaded[s])
        T.tma_copy(gamma[hv, c0 + i, 0:C], g_s[s, :], barrier=loaded[s])
        T.barrier_arrive(loaded[s])

    @T.prim_func
    def gdn_state_output_wide(
        q: T.Tensor((1, num_tokens, H, K), dtype),
        k: T.Tensor((1, num_tokens, H, K), dtype),
        a: T.Tensor((1, num_tokens, HV, C), dtype),
        v: T.Tensor((1, num_tokens, HV, V), dtype),
        gamma: T.Tensor((HV, num_chunks, C), accum),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        chunk_offsets: T.Tensor((num_seqs + 1,), "int32"),
        h0: T.Tensor((num_h0, HV, K, V), accum),
        o: T.Tensor((1, num_tokens, HV, V), dtype),
        ht: T.Tensor((num_ht, HV, K, V), accum),
        scale: T.float32,
        hs: T.Tensor((1, 1, 1, 1), dtype),     # state_output_pipelined.py's contract: S0 per chunk, never stored here
        walk: T.Tensor((num_walk, HV), "int32"),
        before: T.Tensor((num_walk,), "int32"),
    ):
        with T.Kernel(HV, num_seqs, threads=THREADS) as (hv, n):
            hk = hv // GROUP
            bos, eos, n_own, c0 = sequence_bounds(cu_seqlens, chunk_offsets, n)
            # the run: `pre` chunks walked back (chained; they have no output), then the program's own
            pre, exact, bos_run, c0_run = walked_run(walk, before, n, hv, bos, c0, chained)
            n_chunks = pre + n_own

            q_s = T.alloc_shared((STAGES, C, K), dtype)
            k_s = T.alloc_shared((STAGES, C, K), dtype)
            a_s = T.alloc_shared((STAGES, C, C), dtype)
            v_s = T.alloc_shared((STAGES, C, V), dtype)
            g_s = T.alloc_shared((STAGES, C), accum)
            s_s = T.alloc_shared((K, V), dtype)           # bf16 S of chunk i: x's W S, the output's Q S
            u_s = T.alloc_shared((2, C, V), dtype)        # U of chunk i: the owner's K_d^T U, the output's P U
            ag_s = T.alloc_shared((C, C), dtype)          # Tb diag(Gamma), W's left operand
            kd_s = T.alloc_shared((C, K), dtype)          # K_d = diag(Gamma_C / Gamma) K
            ex_s = T.alloc_shared((C,), accum)            # x: Gamma (0 past the chunk's rows)
            eu_s = T.alloc_shared((C,), accum)            # owner: Gamma_C / Gamma (0 past the chunk's rows)

            S = T.alloc_fragment((K, V), accum)           # owner
            acc_u = T.alloc_fragment((C, V), accum)       # x: W, then U', then U
            w_f = T.alloc_fragment((C, K), dtype)         # x: -W of the chunk it works on next (W S's A operand)
            acc_o = T.alloc_fragment((C, V), accum)       # output
            qk = T.alloc_fragment((C, C), accum)
            p = T.alloc_fragment((C, C), dtype)
            e_o = T.alloc_fragment((C,), accum)           # output: Gamma
            g_last = T.alloc_var(accum)

            loaded = T.alloc_barrier(arrive_count=[128] * STAGES)   # the output warpgroup's arrivals + TMA bytes
            freed = T.alloc_barrier(arrive_count=[384] * STAGES)
            s_ready = T.alloc_barrier(arrive_count=128)
            s_free = T.alloc_barrier(arrive_count=256)
            u_ready = T.alloc_barrier(arrive_count=[128, 128])
            u_free = T.alloc_barrier(arrive_count=[128, 128])

            tx = T.get_thread_binding()
            if tx < 128:
                # ---- owner: S in registers ----
                if has_initial_state and exact:
                    T.copy(h0[n, hv, 0:K, 0:V], S)
                else:
                    T.clear(S)
                T.copy(S, s_s)
                T.fence_proxy_async()
                T.barrier_arrive(s_ready)
                for i in T.serial(n_chunks):
                    s = i % STAGES
                    h = i % 2
                    n_valid = T.min(eos - bos_run - i * C, C)
                    T.barrier_wait(loaded[s], (i // STAGES) % 2)
                    # while x runs W S: Gamma_C S and K_d (its previous reader, this role's last product, is done)
                    g_last = g_s[s, n_valid - 1]
                    for r in T.Parallel(C):
                        eu_s[r] = T.if_then_else(r < n_valid, T.exp(g_last - g_s[s, r]), 0.0)
                    for r, j in T.Parallel(K, V):
                        S[r, j] = S[r, j] * T.exp(g_last)
                    for r, c in T.Parallel(C, K):
                        kd_s[r, c] = k_s[s, r, c] * eu_s[r]
                    T.fence_proxy_async()
                    T.barrier_wait(u_ready[h], (i // 2) % 2)
                    T.wgmma_gemm(kd_s, u_s[h, :, :], S, transpose_A=True)                # += K_d^T U
                    T.wait_wgmma(0)
                    T.barrier_arrive(freed[s])
                    if i + 1 < n_chunks:
                        T.barrier_wait(s_free, i % 2)                                  # x and output read S_i
                        T.copy(S, s_s)
                        T.fence_proxy_async()
                        T.barrier_arrive(s_ready)
                if store_final_state:
                    T.copy(S, ht[n, hv, 0:K, 0:V])
            elif tx < 256:
                # ---- x: W and U' of the next chunk off the chain, U = U' - W S on it ----
                T.clear(acc_u)                                # read (as U') only after chunk 0's is made
                T.clear(w_f)                                  # (likewise -W)
                for i in T.serial(n_chunks + 1):
                    if i > 0:
                        h = (i - 1) % 2
                        n_valid = T.min(eos - bos_run - (i - 1) * C, C)
                        T.barrier_wait(s_ready, (i - 1) % 2)
                        T.wgmma_gemm(w_f, s_s, acc_u)                                  # U' + (-W) S
                        T.wait_wgmma(0)
                        T.barrier_arrive(s_free)
                        T.barrier_wait(u_free[h], (((i - 1) // 2) % 2) ^ 1)
                        for r, j in T.Parallel(C, V):
                            u_s[h, r, j] = T.if_then_else(r < n_valid, acc_u[r, j], 0.0)
                        T.fence_proxy_async()
                        T.barrier_arrive(u_ready[h])
                    if i < n_chunks:
                        s = i % STAGES
                        n_valid = T.min(eos - bos_run - i * C, C)
                        T.barrier_wait(loaded[s], (i // STAGES) % 2)
                        for r in T.Parallel(C):
                            ex_s[r] = T.if_then_else(r < n_valid, T.exp(g_s[s, r]), 0.0)
                        for r, c in T.Parallel(C, C):
                            ag_s[r, c] = a_s[s, r, c] * ex_s[c]
                        T.fence_proxy_async()
                        T.wgmma_gemm(ag_s, k_s[s, :, :], acc_u, clear_accum=True)       # W = Tb diag(Gamma) K
                        T.wait_wgmma(0)
                        # -W stays in registers, laid out as W S's A operand (the accumulator's own layout):
                        # through shared memory its 16 KB store took ~590 clocks of x's ~5000-clock step (clock64
                        # trace)
                        for r, c in T.Parallel(C, K):
                            w_f[r, c] = -acc_u[r, c]
                        T.wgmma_gemm(a_s[s, :, :], v_s[s, :, :], acc_u, clear_accum=True)  # U' = Tb V
                        T.wait_wgmma(0)
                        T.barrier_arrive(freed[s])
            else:
                # ---- output, and the loads ----
                for i in T.serial(T.min(n_chunks, STAGES)):
                    load(q, k, a, v, gamma, q_s, k_s, a_s, v_s, g_s, loaded, bos_run, c0_run, hk, hv, i, i, i >= pre)
                for i in T.serial(n_chunks):
                    s = i % STAGES
                    h = i % 2
                    t0 = bos_run + i * C
                    n_valid = T.min(eos - t0, C)
                    T.barrier_wait(loaded[s], (i // STAGES) % 2)
                    if i >= pre:
                        # P before S arrives: with one S slot the owner hands over the next S only once Q S is
                        # done, so at s_ready Q S is the only product left here
                        T.wgmma_gemm(q_s[s, :, :], k_s[s, :, :], qk, transpose_B=True, clear_accum=True)  # Q K^T
                        for r in T.Parallel(C):
                            e_o[r] = T.exp(g_s[s, r])
                        T.wait_wgmma(0)
                        for r, c in T.Parallel(C, C):
                            qk[r, c] = T.if_then_else(r >= c, T.if_then_else(r < n_valid, qk[r, c] * T.exp(g_s[s, r] - g_s[s, c]), 0.0), 0.0)
                        T.copy(qk, p)
                        T.barrier_wait(s_ready, i % 2)
                        T.wgmma_gemm(q_s[s, :, :], s_s, acc_o, clear_accum=True)                # Q S
                        T.wait_wgmma(0)
                        T.barrier_arrive(s_free)
                        for r, j in T.Parallel(C, V):
                            acc_o[r, j] = acc_o[r, j] * e_o[r]
                        T.barrier_wait(u_ready[h], (i // 2) % 2)
                        T.wgmma_gemm(p, u_s[h, :, :], acc_o)                                    # += P U
                        T.wait_wgmma(0)
                    else:  # a walked chunk: no output, only the hand-overs released
                        T.barrier_wait(s_ready, i % 2)
                        T.barrier_arrive(s_free)
                        T.barrier_wait(u_ready[h], (i // 2) % 2)
                    # done with stage s; once the owner (K_d^T U: also its read of U's slot) and x are too, the
                    # stage takes chunk i + STAGES
                    T.barrier_arrive(freed[s])
                    T.barrier_wait(freed[s], (i // STAGES) % 2)
                    if i + STAGES < n_chunks:
                        load(q, k, a, v, gamma, q_s, k_s, a_s, v_s, g_s, loaded, bos_run, c0_run, hk, hv, i + STAGES, s,
                             i + STAGES >= pre)
                    # a full chunk's O leaves by one TMA store staged in U's slot (x refills it for chunk i + 2
                    # only after u_free); from registers, its scattered 4-byte stores kept the load/store unit
                    # busy ~2400 clocks a chunk beside x's shared-memory work (clock64 trace). A tail
                    # chunk stores its valid rows only: a TMA box would overwrite the next sequence's.
                    if i >= pre:
                        if n_valid == C:
                            for r, j in T.Parallel(C, V):
                                u_s[h, r, j] = acc_o[r, j] * scale
                            T.fence_proxy_async()
                            T.copy(u_s[h, :, :], o[0, t0:t0 + C, hv, 0:V])
                        else:
                            for r, j in T.Parallel(C, V):
                                if r < n_valid:
                                    o[0, t0 + r, hv, j] = acc_o[r, j] * scale
                    T.barrier_arrive(u_free[h])

    return gdn_state_output_wide
