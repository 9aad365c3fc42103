"""The backward's parallel part (issue 6, docs/sm90-design.md): per (chunk, key head), for each of the key head's value
heads in turn, from the state S0 entering the chunk, its dS_end, dU and dX (backward_state.py), everything else:

    X  = V - diag(Gamma) K S0,  U = Tb X                       (recomputed, as the forward made them)
    dP = s dO U^T,  dPD = dP (.) D_incl
    dq = diag(s Gamma) dO S0^T + dPD K
    dTb = dU X^T,  dT = dTb diag(beta),  dA = strictly_lower(-T^T dT T^T),  H = diag(beta) dA (.) D
    dk = dPD^T Q + diag(Gamma_C / Gamma) U dS_end^T - diag(Gamma) dX S0^T + H K + H^T K
    dbeta_j = sum_i dTb_ij T_ij + sum_k dA_jk (K K^T (.) D)_jk
    dgamma: rows minus columns of (dP (.) Q K^T + diag(beta) dA (.) K K^T) (.) D, the diag(Gamma) terms of O
            and X, the decays Gamma_C / Gamma of the state update and Gamma_C's carry <S0, dS_end>;
    dg = the chunk's reverse cumsum of dgamma

backends/reference/chunked_backward.py is the definition (chunk_local_grads, term for term). dq and dk are summed
over the key head's value heads in the program, in the products' fp32 accumulators (value head order: bitwise
repeatable), and written once per key head: no [T, HV, K] fp32 pair and no GVA sum afterwards; Q and K are
loaded once for the group.

Two warpgroups per program, splitting each product's columns; every product on wgmma (21 of them) (bf16 operands from
shared memory, fp32 accumulators; dq and dk accumulate across the group loop in two fragments). Shared tiles are reused as the work moves on
(V -> X, dO -> s Gamma dO, dX -> -Gamma dX, dU -> (Gamma_C / Gamma) U), ~216 KB at one program per SM. T (not
only Tb) comes from the forward: beta can be 0, where Tb's column says nothing about T's.

Rows past a sequence's end read as zero (TMA clips at the tensor's end; inside the tensor they are the next
sequence's rows, which every product here masks through the n_valid selects on gamma, X, U, dO and beta).
"""
import tilelang
import tilelang.language as T

CHUNK = 64
THREADS = 256
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


def chunk_grads_program(H: int, HV: int, dtype: str = "bfloat16", K: int = 128, V: int = 128,
                        grads_dtype: str = "float32"):
    """grads_dtype: what dq and dk are written in, the inputs' dtype where nothing follows but the cast to
    it (each is summed in fp32 before the one rounding), fp32 where the l2norm backward still runs on them."""
    C = CHUNK
    accum = "float32"
    assert HV % H == 0 and K == 128 and V == 128
    GROUP = HV // H
    BK = 32  # column block of the <S0, dS_end> reduction (a K x 32 fp32 fragment at a time)

    num_tokens = T.dynamic("num_tokens")
    num_seqs = T.dynamic("num_seqs")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def gdn_chunk_grads(
        q: T.Tensor((1, num_tokens, H, K), dtype),
        k: T.Tensor((1, num_tokens, H, K), dtype),
        v: T.Tensor((1, num_tokens, HV, V), dtype),
        do: T.Tensor((1, num_tokens, HV, V), dtype),
        du: T.Tensor((1, num_tokens, HV, V), dtype),
        dx: T.Tensor((1, num_tokens, HV, V), dtype),
        tb: T.Tensor((1, num_tokens, HV, C), dtype),
        tm: T.Tensor((1, num_tokens, HV, C), dtype),
        gamma: T.Tensor((HV, num_chunks, C), accum),
        beta: T.Tensor((1, num_tokens, HV), accum),
        h: T.Tensor((num_chunks, HV, K, V), dtype),
        dh: T.Tensor((num_chunks, HV, K, V), dtype),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        chunk_indices: T.Tensor((num_chunks, 2), "int32"),
        dq: T.Tensor((1, num_tokens, H, K), grads_dtype),
        dk: T.Tensor((1, num_tokens, H, K), grads_dtype),
        dg: T.Tensor((1, num_tokens, HV), accum),
        dbeta: T.Tensor((1, num_tokens, HV), accum),
        scale: T.float32,
    ):
        with T.Kernel(num_chunks, H, threads=THREADS) as (bc, hk):
            seq = chunk_indices[bc, 0]
            t0 = cu_seqlens[seq] + chunk_indices[bc, 1] * C
            n_valid = T.min(cu_seqlens[seq + 1] - t0, C)

            q_s = T.alloc_shared((C, K), dtype)
            k_s = T.alloc_shared((C, K), dtype)
            vx_s = T.alloc_shared((C, V), dtype)      # V, then X
            do_s = T.alloc_shared((C, V), dtype)      # dO, then diag(s Gamma) dO
            du_s = T.alloc_shared((C, V), dtype)      # dU, then diag(Gamma_C / Gamma) U
            dx_s = T.alloc_shared((C, V), dtype)      # dX, then -diag(Gamma) dX
            u_s = T.alloc_shared((C, V), dtype)
            s0_s = T.alloc_shared((K, V), dtype)
            ds_s = T.alloc_shared((K, V), dtype)      # dS_end
            tb_s = T.alloc_shared((C, C), dtype)
            t_s = T.alloc_shared((C, C), dtype)
            pd_s = T.alloc_shared((C, C), dtype)      # dPD
            dt_s = T.alloc_shared((C, C), dtype)      # dT, then H
            # T^T dT (a wgmma operand: bf16) in Tb's tile, dead after U = Tb X: 8 KB less keeps the kernel under the
            # 227 KB a Hopper block may have (232704 bytes of dynamic shared memory plus 2 KB static did not launch)
            m_s = tb_s
            g_s = T.alloc_shared((C,), accum)
            b_s = T.alloc_shared((C,), accum)
            dg_s = T.alloc_shared((C,), accum)

            cv = T.alloc_fragment((C, V), accum)      # K S0, X; Q S0; U; K dS_end
            dq_acc = T.alloc_fragment((C, K), accum)  # dq, summed over the group's value heads
            dk_acc = T.alloc_fragment((C, K), accum)  # dk, the same
            qk = T.alloc_fragment((C, C), accum)      # Q K^T, K Q^T, then the products whose rows are summed
            kk = T.alloc_fragment((C, C), accum)      # K K^T
            cc = T.alloc_fragment((C, C), accum)      # dP, its transpose; dTb, its transpose; T^T dT; dA, dA^T
            sk = T.alloc_fragment((K, BK), accum)
            # Gamma and Gamma_C / Gamma on the valid rows, in shared memory: as (C,) fragments they would lay
            # the (C, V) rescalings of shared tiles out on one thread in four (the fragments' replicas)
            e_g = T.alloc_shared((C,), accum)
            e_u = T.alloc_shared((C,), accum)
            row = T.alloc_fragment((C,), accum)       # a per-row sum
            dgam = T.alloc_fragment((C,), accum)
            dbt = T.alloc_fragment((C,), accum)
            part = T.alloc_fragment((K,), accum)
            carry = T.alloc_fragment((1,), accum)     # sum of de
            tot = T.alloc_fragment((1,), accum)       # <S0, dS_end>
            g_last = T.alloc_var(accum)

            # Q and K once for the group; each value head's eight other tiles arrive in four groups, in the order
            # the products first need them (one program per SM: nothing else hides the loads)
            qk_loaded = T.alloc_barrier(arrive_count=[THREADS])
            T.tma_copy(k[0, t0:t0 + C, hk, 0:K], k_s, barrier=qk_loaded[0])
            T.tma_copy(q[0, t0:t0 + C, hk, 0:K], q_s, barrier=qk_loaded[0])
            T.barrier_arrive(qk_loaded[0])
            loaded = T.alloc_barrier(arrive_count=[THREADS] * 4)
            T.clear(dq_acc)
            T.clear(dk_acc)
            for jv in T.serial(GROUP):
                hv = hk * GROUP + jv
                parity = jv % 2
                # every reader of the previous value head's tiles is done before the loads below refill them, and
                # the tiles threads rewrote in place (V -> X, dO, dU, dX) are ordered before TMA's writes
                T.sync_threads()
                T.fence_proxy_async()
                T.tma_copy(h[bc, hv, 0:K, 0:V], s0_s, barrier=loaded[0])
                T.tma_copy(v[0, t0:t0 + C, hv, 0:V], vx_s, barrier=loaded[0])
                T.tma_copy(dx[0, t0:t0 + C, hv, 0:V], dx_s, barrier=loaded[0])
                T.tma_copy(do[0, t0:t0 + C, hv, 0:V], do_s, barrier=loaded[1])
                T.tma_copy(tb[0, t0:t0 + C, hv, 0:C], tb_s, barrier=loaded[2])
                T.tma_copy(dh[bc, hv, 0:K, 0:V], ds_s, barrier=loaded[2])
                T.tma_copy(du[0, t0:t0 + C, hv, 0:V], du_s, barrier=loaded[3])
                T.tma_copy(tm[0, t0:t0 + C, hv, 0:C], t_s, barrier=loaded[3])
                T.barrier_arrive(loaded[0])
                T.barrier_arrive(loaded[1])
                T.barrier_arrive(loaded[2])
                T.barrier_arrive(loaded[3])
                for i in T.Parallel(C):
                    g_s[i] = gamma[hv, bc, i]
                    b_s[i] = T.if_then_else(i < n_valid, beta[0, t0 + i, hv], 0.0)
                T.barrier_wait(loaded[0], parity)
                T.barrier_wait(qk_loaded[0], 0)   # completed once, before the first value head: passes at once after
                g_last = g_s[n_valid - 1]
                for i in T.Parallel(C):
                    e_g[i] = T.if_then_else(i < n_valid, T.exp(g_s[i]), 0.0)
                    e_u[i] = T.if_then_else(i < n_valid, T.exp(g_last - g_s[i]), 0.0)

                # ---- X = V - diag(Gamma) K S0 (into V's tile); dgamma -= Gamma (dX (.) K S0) row sums ----
                T.gemm(k_s, s0_s, cv, clear_accum=True)
                for i, j in T.Parallel(C, V):
                    vx_s[i, j] = T.if_then_else(i < n_valid, vx_s[i, j] - e_g[i] * cv[i, j], 0.0)
                    cv[i, j] = cv[i, j] * dx_s[i, j]
                T.reduce_sum(cv, row, dim=1)
                for i in T.Parallel(C):
                    dgam[i] = -e_g[i] * row[i]
                # ---- dgamma += s Gamma (dO (.) Q S0) row sums ----
                T.barrier_wait(loaded[1], parity)
                T.gemm(q_s, s0_s, cv, clear_accum=True)
                for i, j in T.Parallel(C, V):
                    cv[i, j] = cv[i, j] * do_s[i, j]
                T.reduce_sum(cv, row, dim=1)
                for i in T.Parallel(C):
                    dgam[i] += scale * e_g[i] * row[i]
                # ---- U = Tb X ----
                T.barrier_wait(loaded[2], parity)
                T.gemm(tb_s, vx_s, cv, clear_accum=True)
                for i, j in T.Parallel(C, V):
                    u_s[i, j] = T.if_then_else(i < n_valid, cv[i, j], 0.0)
                # ---- de = (K dS_end (.) U) row sums (Gamma_C / Gamma): dgamma -= de, Gamma_C gets sum(de) ----
                T.gemm(k_s, ds_s, cv, clear_accum=True)
                for i, j in T.Parallel(C, V):
                    cv[i, j] = cv[i, j] * u_s[i, j]
                T.reduce_sum(cv, row, dim=1)
                for i in T.Parallel(C):
                    row[i] = row[i] * e_u[i]
                    dgam[i] -= row[i]
                T.reduce_sum(row, carry, dim=0)
                # Gamma_C <S0, dS_end>, in K x 32 column blocks
                T.clear(part)
                for jb in T.serial(V // BK):
                    for i, j in T.Parallel(K, BK):
                        sk[i, j] = T.cast(s0_s[i, jb * BK + j], accum) * T.cast(ds_s[i, jb * BK + j], accum)
                    T.reduce_sum(sk, part, dim=1, clear=False)
                T.reduce_sum(part, tot, dim=0)
                for i in T.Parallel(C):
                    dgam[i] += T.if_then_else(i == n_valid - 1, T.exp(g_last) * tot[0] + carry[0], 0.0)

                # Column sums would need a second fragment layout; each is taken instead as the row sums of the
                # transposed product (one more small gemm), so every per-row vector shares the accumulators' rows.
                # ---- dP = s dO U^T; dPD = dP (.) D; dgamma += rows of dP (.) Q K^T (.) D ----
                T.gemm(do_s, u_s, cc, transpose_B=True, clear_accum=True)
                T.gemm(q_s, k_s, qk, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    d = T.if_then_else((i >= j) & (i < n_valid), T.exp(g_s[i] - g_s[j]), 0.0)
                    pd_s[i, j] = scale * cc[i, j] * d
                    qk[i, j] = scale * cc[i, j] * qk[i, j] * d
                T.reduce_sum(qk, row, dim=1)
                for i in T.Parallel(C):
                    dgam[i] += row[i]
                # ... minus its columns: rows of (dP (.) Q K^T (.) D)^T = s U dO^T (.) K Q^T (.) D^T
                T.gemm(u_s, do_s, cc, transpose_B=True, clear_accum=True)
                T.gemm(k_s, q_s, qk, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    qk[i, j] = scale * cc[i, j] * qk[i, j] * T.if_then_else((j >= i) & (j < n_valid), T.exp(g_s[j] - g_s[i]), 0.0)
                T.reduce_sum(qk, row, dim=1)
                for i in T.Parallel(C):
                    dgam[i] -= row[i]
                # ---- dTb = dU X^T (dU's rows past n_valid are another sequence's: masked); dT = dTb diag(beta);
                # dbeta = columns of dTb (.) T = rows of X dU^T (.) T^T ----
                T.barrier_wait(loaded[3], parity)
                T.gemm(du_s, vx_s, cc, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    dt_s[i, j] = T.if_then_else(i < n_valid, cc[i, j] * b_s[j], 0.0)
                T.gemm(vx_s, du_s, cc, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    qk[i, j] = T.if_then_else(j < n_valid, cc[i, j] * T.cast(t_s[j, i], accum), 0.0)
                T.reduce_sum(qk, dbt, dim=1)
                # ---- dA = strictly_lower(-(T^T dT) T^T), and dA^T = -T (T^T dT)^T for the column sums ----
                T.gemm(t_s, dt_s, cc, transpose_A=True, clear_accum=True)
                T.copy(cc, m_s)
                T.fence_proxy_async()
                T.gemm(k_s, k_s, kk, transpose_B=True, clear_accum=True)           # K K^T (symmetric)
                T.gemm(m_s, t_s, cc, transpose_B=True, clear_accum=True)
                # dbeta += rows of dA (.) K K^T (.) D; dgamma += rows of diag(beta) dA (.) K K^T (.) D;
                # H = diag(beta) dA (.) D (into dT's tile)
                for i, j in T.Parallel(C, C):
                    d = T.if_then_else((i > j) & (i < n_valid), T.exp(g_s[i] - g_s[j]), 0.0)
                    dt_s[i, j] = -b_s[i] * cc[i, j] * d
                    qk[i, j] = -cc[i, j] * kk[i, j] * d
                T.reduce_sum(qk, row, dim=1)
                for i in T.Parallel(C):
                    dbt[i] += row[i]
                    dgam[i] += b_s[i] * row[i]
                # ... minus its columns: rows of (diag(beta) dA (.) K K^T (.) D)^T, with dA^T = -T (T^T dT)^T
                T.gemm(t_s, m_s, cc, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    qk[i, j] = -b_s[j] * cc[i, j] * kk[i, j] * T.if_then_else((j > i) & (j < n_valid), T.exp(g_s[j] - g_s[i]), 0.0)
                T.reduce_sum(qk, row, dim=1)
                for i in T.Parallel(C):
                    dgam[i] -= row[i]

                # ---- dq = diag(s Gamma) dO S0^T + dPD K ----
                for i, j in T.Parallel(C, V):
                    do_s[i, j] = do_s[i, j] * (scale * e_g[i])
                T.gemm(do_s, s0_s, dq_acc, transpose_B=True)
                T.gemm(pd_s, k_s, dq_acc)
                # ---- dk = dPD^T Q + diag(Gamma_C / Gamma) U dS_end^T - diag(Gamma) dX S0^T + H K + H^T K ----
                for i, j in T.Parallel(C, V):
                    du_s[i, j] = u_s[i, j] * e_u[i]
                    dx_s[i, j] = -dx_s[i, j] * e_g[i]
                T.gemm(pd_s, q_s, dk_acc, transpose_A=True)
                T.gemm(du_s, ds_s, dk_acc, transpose_B=True)
                T.gemm(dx_s, s0_s, dk_acc, transpose_B=True)
                T.gemm(dt_s, k_s, dk_acc)
                T.gemm(dt_s, k_s, dk_acc, transpose_A=True)

                # ---- dg = reverse cumsum of dgamma within the chunk; dbeta ----
                for i in T.Parallel(C):
                    dg_s[i] = T.if_then_else(i < n_valid, dgam[i], 0.0)
                T.cumsum(src=dg_s, dim=0, reverse=True)
                for i in T.Parallel(C):
                    if i < n_valid:
                        dg[0, t0 + i, hv] = dg_s[i]
                        dbeta[0, t0 + i, hv] = dbt[i]

            if grads_dtype == dtype and n_valid == C:
                # a full chunk's dq and dk leave by TMA store, staged in Q's and K's tiles (dead after the last
                # value head): per-thread stores from the accumulators took ~3900 clocks of a ~61000-clock
                # program (clock64 timeline, H200)
                T.sync_threads()
                T.copy(dq_acc, q_s)
                T.copy(dk_acc, k_s)
                T.fence_proxy_async()
                T.copy(q_s, dq[0, t0:t0 + C, hk, 0:K])
                T.copy(k_s, dk[0, t0:t0 + C, hk, 0:K])
            else:
                for i, j in T.Parallel(C, K):
                    if i < n_valid:
                        dq[0, t0 + i, hk, j] = T.cast(dq_acc[i, j], grads_dtype)
                        dk[0, t0 + i, hk, j] = T.cast(dk_acc[i, j], grads_dtype)

    return gdn_chunk_grads
