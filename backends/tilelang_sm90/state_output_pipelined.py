"""The sequential half of the chunked forward (docs/algorithm.md section 2), fused with the output: one TileLang
program per (sequence, value head, V tile) walks the sequence's chunks with the state on chip:

    U     = Tb (V - diag(Gamma) K S)                      (C x BV; = U' - W S, Tb from intra_chunk.py)
    O     = scale ( diag(Gamma) Q S + (Q K^T (.) D_incl) U )
    S_end = Gamma_C S + K^T diag(Gamma_C / Gamma) U       (= Gamma_C S + Kt^T U)

S [K, BV] stays an fp32 register fragment from the first chunk to the last; each chunk rounds a bf16 copy of
it into shared memory, the operand of K S and Q S (docs/algorithm.md section 2, precision: this rounding is most of the
~3e-3 error the anchors show). The decay Gamma_C / Gamma_t is folded into U's rows (one bf16 rounding of
the product) instead of into K, so K's TMA tile is the left operand of the state update as loaded.

The chunk loop is a T.Pipelined loop: the Q, K, Tb, V and gamma tiles of chunk i + 1 stream in by TMA on
mbarriers (2 stages) while chunk i computes; its six products run as three groups of async wgmmas with one
wait each. Tail chunk of a sequence: the Q/K/Tb/V boxes read past the sequence's end (next sequence's rows,
zeros past the tensor's end). Those rows reach results only through selects on `t < n_valid` (the rows of
X and U, Q K^T's rows, the stores), never a multiply, so garbage there cannot leak (0 * inf would); Tb's
columns past n_valid are zero as written. Gamma's rows are the chunk's own (the intra kernel writes every
row of it), so the decays need no select.
"""
import tilelang
import tilelang.language as T

from .sequence_macros import sequence_bounds

CHUNK = 64
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}
TMA = {"prefer_instruction": "tma"}


def state_output_pipelined_program(H: int, HV: int, dtype: str = "bfloat16", has_initial_state: bool = False,
                                   store_final_state: bool = False, block_v: int = 64, num_stages: int = 2,
                                   threads: int = 128, store_states: bool = False, K: int = 128, V: int = 128):
    """The TileLang prim_func. Token count, sequence count and the state tensors' lengths are symbolic;
    `scale` is a runtime argument, so one build serves every scale. store_states (training): also write every
    chunk's entering state S0 in bf16 to `hs` [num_chunks, HV, K, V]; otherwise `hs` is a 1-element
    placeholder the kernel never touches."""
    # ---- tile shapes ----
    C = CHUNK        # chunk rows: Q/K tiles are C x K, V/X/U/O tiles C x BV, Tb and Q K^T are C x C
    BV = block_v     # V tile per program: 64 -> S is 128 x 64 fp32 = 64 registers/thread at 128 threads;
                     # 2 V tiles per (sequence, head) double the programs for few-sequence problems
    NV = V // BV
    accum = "float32"
    assert HV % H == 0 and K == 128 and V == 128 and V % BV == 0
    GROUP = HV // H

    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_seqs = T.dynamic("num_seqs")
    num_h0 = T.dynamic("num_h0")  # N with an initial state, else 1 (a placeholder that is never read)
    num_ht = T.dynamic("num_ht")  # N with a final state, else 1 (never written)

    HS_SHAPE = (num_chunks, HV, K, V) if store_states else (1, 1, 1, 1)

    @T.prim_func
    def gdn_state_output_pipelined(
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
        hs: T.Tensor(HS_SHAPE, dtype),
    ):
        # V tiles fastest: the programs sharing one (sequence, head) run together and share Q/K/Tb in L2
        with T.Kernel(NV, HV, num_seqs, threads=threads) as (bv, hv, n):
            hk = hv // GROUP
            v0 = bv * BV
            bos, eos, n_chunks, c0 = sequence_bounds(cu_seqlens, chunk_offsets, n)

            # pipelined operand tiles (TileLang multi-buffers them num_stages deep)
            q_s = T.alloc_shared((C, K), dtype)
            k_s = T.alloc_shared((C, K), dtype)
            a_s = T.alloc_shared((C, C), dtype)       # Tb
            v_s = T.alloc_shared((C, BV), dtype)
            g_s = T.alloc_shared((C,), accum)         # gamma of the chunk
            # per-chunk operands made on chip
            s_s = T.alloc_shared((K, BV), dtype)      # bf16 copy of S
            x_s = T.alloc_shared((C, BV), dtype)      # X = V - diag(Gamma) K S
            u_s = T.alloc_shared((C, BV), dtype)      # U
            ud_s = T.alloc_shared((C, BV), dtype)     # diag(Gamma_C / Gamma) U
            p_s = T.alloc_shared((C, C), dtype)       # Q K^T (.) D_incl

            S = T.alloc_fragment((K, BV), accum)
            xu = T.alloc_fragment((C, BV), accum)     # K S, X, then U
            acc_o = T.alloc_fragment((C, BV), accum)
            qk = T.alloc_fragment((C, C), accum)
            # per-row decays, one exp per row instead of one per element of a (C, BV) tile
            e_g = T.alloc_fragment((C,), accum)       # Gamma: the rows of K S and of Q S
            e_u = T.alloc_fragment((C,), accum)       # Gamma_C / Gamma: the rows of U
            g_last = T.alloc_var(accum)

            if has_initial_state:
                T.copy(h0[n, hv, 0:K, v0:v0 + BV], S)
            else:
                T.clear(S)

            for ic in T.Pipelined(n_chunks, num_stages=num_stages):
                t0 = bos + ic * C
                n_valid = T.min(eos - t0, C)
                T.copy(q[0, t0:t0 + C, hk, 0:K], q_s, annotations=TMA)
                T.copy(k[0, t0:t0 + C, hk, 0:K], k_s, annotations=TMA)
                T.copy(a[0, t0:t0 + C, hv, 0:C], a_s, annotations=TMA)
                T.copy(v[0, t0:t0 + C, hv, v0:v0 + BV], v_s, annotations=TMA)
                T.copy(gamma[hv, c0 + ic, 0:C], g_s, annotations=TMA)

                # group 1, issued together and waited on once: K S, Q S, Q K^T (all read this chunk's tiles and S)
                T.copy(S, s_s)
                T.fence_proxy_async()
                if store_states:
                    T.copy(s_s, hs[c0 + ic, hv, 0:K, v0:v0 + BV])
                T.wgmma_gemm(k_s, s_s, xu, clear_accum=True)
                T.wgmma_gemm(q_s, s_s, acc_o, clear_accum=True)
                T.wgmma_gemm(q_s, k_s, qk, transpose_B=True, clear_accum=True)
                g_last = g_s[n_valid - 1]
                for i in T.Parallel(C):
                    e_g[i] = T.exp(g_s[i])
                    e_u[i] = T.exp(g_last - g_s[i])
                T.wait_wgmma(0)

                # group 2: U = Tb X with X = V - diag(Gamma) K S on the valid rows (0 elsewhere)
                for i, j in T.Parallel(C, BV):
                    xu[i, j] = T.if_then_else(i < n_valid, v_s[i, j] - xu[i, j] * e_g[i], 0.0)
                T.copy(xu, x_s)
                T.fence_proxy_async()
                T.wgmma_gemm(a_s, x_s, xu, clear_accum=True)
                T.wait_wgmma(0)

                # CUDA-core work before the last group: U and its decayed copy on the valid rows (0 elsewhere),
                # the masked decayed Q K^T, diag(Gamma) Q S, Gamma_C S
                for i, j in T.Parallel(C, BV):
                    xu[i, j] = T.if_then_else(i < n_valid, xu[i, j], 0.0)
                T.copy(xu, u_s)
                for i, j in T.Parallel(C, BV):
                    ud_s[i, j] = xu[i, j] * e_u[i]
                # Q K^T (.) D_incl: causal incl. the diagonal, masked before the exp
                for i, j in T.Parallel(C, C):
                    qk[i, j] = T.if_then_else(i >= j, T.if_then_else(i < n_valid, qk[i, j] * T.exp(g_s[i] - g_s[j]), 0.0), 0.0)
                T.copy(qk, p_s)
                for i, j in T.Parallel(C, BV):
                    acc_o[i, j] = acc_o[i, j] * e_g[i]
                for i, j in T.Parallel(K, BV):
                    S[i, j] = S[i, j] * T.exp(g_last)

                # group 3: O += (Q K^T (.) D_incl) U and S += K^T diag(Gamma_C / Gamma) U, in flight together
                T.fence_proxy_async()
                T.wgmma_gemm(p_s, u_s, acc_o)
                T.wgmma_gemm(k_s, ud_s, S, transpose_A=True)
                T.wait_wgmma(0)
                for i, j in T.Parallel(C, BV):
                    if i < n_valid:
                        o[0, t0 + i, hv, v0 + j] = acc_o[i, j] * scale

            if store_final_state:
                T.copy(S, ht[n, hv, 0:K, v0:v0 + BV])

    return gdn_state_output_pipelined
