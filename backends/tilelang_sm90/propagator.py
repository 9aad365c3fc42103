"""Context parallelism, step 1 (docs/algorithm.md section 4): every segment's state transition, in TileLang.

A segment of a sequence maps its initial state S_0 to its final state linearly:

    S_end = P S_0 + E        P [K, K], E [K, V]

The chain of state_output_narrow.py, S -> Gamma_C S + K^T diag(Gamma_C / Gamma) Tb (V - diag(Gamma) K S), is
linear in (S, V). E is it run from S_0 = 0, and P it run on the K x K identity with V = 0. So one program
runs the state chain alone, with no output, on a BV-wide column tile of [E | P]: tiles left of V start from
zeros and read V, tiles right of it start from identity columns and read no V. It reads what the plain
forward reads (K, Tb, V, gamma), so context parallelism needs no other intra-kernel output. It writes aug
[segments, HV, K, V + K] fp32, the layout triton_generic's segment scan reads. A CTA does nothing where `gate`
holds 0 for its (segment, head): the gated route launches it always and lets the device decide which pairs need
their transition (forward._initial_states).

Two warpgroups: a TMA producer (K, Tb, V and gamma of chunk i into stage i % 2) and the state chain,
on the same two 2-slot mbarrier rings as state_output_narrow.py:
    loaded[s]  producer -> chain: stage s holds chunk i (TMA bytes + 128 producer arrivals)
    freed[s]   chain -> producer: stage s may be overwritten (128 arrivals; its wait uses the flipped
               parity, so round 0 passes at once)
"""
import tilelang
import tilelang.language as T

from .sequence_macros import sequence_bounds

CHUNK = 64
THREADS = 256
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
                # the roles and barriers are written out here: TileLang's own pipeliner must stay out
                tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}


def propagator_program(H: int, HV: int, dtype: str = "bfloat16", block_v: int = 64, K: int = 128, V: int = 128):
    C = CHUNK
    BV = block_v
    NE = V // BV               # column tiles of E; the next K // BV are P's
    NCOL = (V + K) // BV
    accum = "float32"
    assert HV % H == 0 and K == 128 and V == 128 and BV in (32, 64)
    GROUP = HV // H

    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_segs = T.dynamic("num_segs")
    num_gates = T.dynamic("num_gates")

    @T.prim_func
    def gdn_segment_propagator(
        k: T.Tensor((1, num_tokens, H, K), dtype),
        a: T.Tensor((1, num_tokens, HV, C), dtype),
        v: T.Tensor((1, num_tokens, HV, V), dtype),
        gamma: T.Tensor((HV, num_chunks, C), accum),
        cu_seqlens: T.Tensor((num_segs + 1,), "int32"),      # token bounds of the segments
        chunk_offsets: T.Tensor((num_segs + 1,), "int32"),   # chunk-table row of each segment's first chunk
        aug: T.Tensor((num_segs, HV, K, V + K), accum),
        gate: T.Tensor((num_gates, HV), "int32"),             # 0: nothing to do (the gated route's flags)
    ):
        with T.Kernel(NCOL, HV, num_segs, threads=THREADS) as (bc, hv, n):
            hk = hv // GROUP
            col0 = bc * BV
            bos, eos, n_chunks, c0 = sequence_bounds(cu_seqlens, chunk_offsets, n)

            k_s = T.alloc_shared((2, C, K), dtype)
            a_s = T.alloc_shared((2, C, C), dtype)
            v_s = T.alloc_shared((2, C, BV), dtype)
            g_s = T.alloc_shared((2, C), accum)
            s_s = T.alloc_shared((K, BV), dtype)      # bf16 S, the right operand of K S
            x_s = T.alloc_shared((C, BV), dtype)      # X = V - diag(Gamma) K S, then diag(Gamma_C / Gamma) U

            S = T.alloc_fragment((K, BV), accum)
            x = T.alloc_fragment((C, BV), accum)      # K S, X, then U
            e_x = T.alloc_fragment((C,), accum)       # Gamma on the valid rows
            e_u = T.alloc_fragment((C,), accum)       # Gamma_C / Gamma
            g_last = T.alloc_var(accum)

            loaded = T.alloc_barrier(arrive_count=[128, 128])
            freed = T.alloc_barrier(arrive_count=[128, 128])

            tx = T.get_thread_binding()
            # the flag of this CTA's (segment, head); one row of ones (forward.open_gate) opens every CTA
            if gate[T.min(n, num_gates - 1), hv] > 0:  # every thread reads the same flag: the CTA leaves or stays
                if tx < 128:
                    # ---- producer ----
                    for i in T.serial(n_chunks):
                        s = i % 2
                        T.barrier_wait(freed[s], ((i // 2) % 2) ^ 1)
                        t0 = bos + i * C
                        T.tma_copy(k[0, t0:t0 + C, hk, 0:K], k_s[s, :, :], barrier=loaded[s])
                        T.tma_copy(a[0, t0:t0 + C, hv, 0:C], a_s[s, :, :], barrier=loaded[s])
                        T.tma_copy(gamma[hv, c0 + i, 0:C], g_s[s, :], barrier=loaded[s])
                        if bc < NE:
                            T.tma_copy(v[0, t0:t0 + C, hv, col0:col0 + BV], v_s[s, :, :], barrier=loaded[s])
                        T.barrier_arrive(loaded[s])
                else:
                    # ---- state chain: E's tiles from zeros with V, P's from the identity's columns col0 - V ..
                    # with V = 0 ----
                    for r, j in T.Parallel(K, BV):
                        S[r, j] = T.if_then_else(r == col0 - V + j, 1.0, 0.0)
                    for i in T.serial(n_chunks):
                        s = i % 2
                        n_valid = T.min(eos - bos - i * C, C)
                        T.barrier_wait(loaded[s], (i // 2) % 2)
                        T.copy(S, s_s)
                        T.fence_proxy_async()
                        T.wgmma_gemm(k_s[s, :, :], s_s, x, clear_accum=True)              # K S
                        g_last = g_s[s, n_valid - 1]
                        for r in T.Parallel(C):
                            e_x[r] = T.exp(g_s[s, r])
                            e_u[r] = T.exp(g_last - g_s[s, r])
                        T.wait_wgmma(0)
                        for r, j in T.Parallel(C, BV):
                            x[r, j] = T.if_then_else(
                                r < n_valid, T.if_then_else(bc < NE, v_s[s, r, j], 0.0) - x[r, j] * e_x[r], 0.0)
                        T.copy(x, x_s)
                        T.fence_proxy_async()
                        T.wgmma_gemm(a_s[s, :, :], x_s, x, clear_accum=True)              # U = Tb X
                        T.wait_wgmma(0)
                        for r, j in T.Parallel(C, BV):
                            x_s[r, j] = T.if_then_else(r < n_valid, x[r, j] * e_u[r], 0.0)
                        T.fence_proxy_async()
                        for r, j in T.Parallel(K, BV):
                            S[r, j] = S[r, j] * T.exp(g_last)
                        T.wgmma_gemm(k_s[s, :, :], x_s, S, transpose_A=True)              # += K^T U_d
                        T.wait_wgmma(0)
                        T.barrier_arrive(freed[s])
                    T.copy(S, aug[n, hv, 0:K, col0:col0 + BV])

    return gdn_segment_propagator
