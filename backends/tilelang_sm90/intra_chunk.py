"""Per (chunk, value head), in parallel over all chunks: the state-independent half of the chunked forward
(ALGORITHM.md section 2), as one TileLang kernel for sm90:

    gamma = chunk-local cumsum of g                          (fp32, CUDA cores)
    A     = strictly_lower( diag(beta) (K K^T (.) D) )       (K K^T on wgmma, bf16 operands, fp32 accumulator)
    T     = (I + A)^-1                                       (fp32: 16x16 diagonal blocks by forward substitution
                                                              on CUDA cores, the rest by 64x64 tf32 gemms)
    Tb    = T diag(beta)                                     (written in the inputs' dtype, [1, T, HV, 64])

The state pass makes the new values from Tb on chip, U = Tb (V - diag(Gamma) K S) (state_output_ws.py), so
W = T diag(beta Gamma) K and U' = T diag(beta) V are not written for it: per chunk and value head Tb is
8 KB where W and U' were 32 KB written here and read back there (16/64 1x32768: ~1.07 GB each way).

gamma is written as [HV, num_chunks, 64] fp32 (natural log, one row per entry of the chunk table, so the
state pass loads a chunk's 64 values with one TMA box whose start is row-aligned. A token-contiguous gamma
read at a sequence's own offset puts an unaligned start in the box's innermost dimension, and that TMA load
raised "illegal instruction" on the H200 for every sequence that does not start at a multiple of 64 tokens.)

The solve. Split (I + A) = Dblk + Aoff, Dblk = the four 16x16 diagonal blocks of I + A, Aoff the strictly
block-lower rest. Then T = (I + N)^-1 Dblk^-1 with N = Dblk^-1 Aoff strictly block-lower (4 blocks), so
N^4 = 0 and (I + N)^-1 = I - N + N^2 - N^3 = (I - N)(I + N^2):
    T = (I - N) (I + N N) Dinv,   Dinv = Dblk^-1,  N = Dinv Aoff          (4 gemms of 64x64x64)
Exact algebra (no approximation). The products run in tf32 on tensor cores (fp32 operands from shared memory):
~1e-3 relative, below the bf16 rounding Tb gets. They lower to mma.sync, which loads a K-major right operand
with ldmatrix (a row-major one with scalar loads: 6% slower, session 4), so every right-hand operand is
stored transposed in shared memory and the gemms use transpose_B=True.

Shared memory is what limits CTAs per SM here (one warpgroup per CTA: the other CTAs on the SM hide each
one's serial steps). Full chunks of Tb leave through shared memory and one TMA store.

Varlen: the grid is the chunk table of gdnkit.seqlayout ([num_chunks, 2] = (sequence, chunk within
the sequence)). A tail chunk's TMA box reads rows past the sequence's end (the next sequence's tokens, or
zeros past the tensor's end): those rows get beta = 0 and g = 0, which makes their rows and columns of Tb
zero and leaves the valid rows exact; stores are masked to the valid rows.
"""

import tilelang
import tilelang.language as T

CHUNK = 64
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}
# Tile loads are TMA (T.tma_copy: cp.async.bulk.tensor on an mbarrier). A plain T.copy would lower to a
# bounds-checked SIMT copy here because the token count is symbolic; TMA boxes clip at the tensor's end by
# themselves (out-of-bounds rows read as zero).


@T.macro
def _store_rows(src, dst, t0, head, n_valid):
    """The C x n shared tile `src` (in dst's dtype) into rows t0.. of dst[0, :, head, :]. A full chunk leaves
    by one TMA store: whole 128-byte lines instead of per-thread 4-byte stores that fill half of each 32-byte
    sector. A tail chunk stores only its valid rows, since a TMA box would also overwrite the next sequence's
    first rows."""
    if n_valid == CHUNK:
        T.copy(src, dst[0, t0:t0 + CHUNK, head, :])
    else:
        for i, j in T.Parallel(CHUNK, src.shape[1]):
            if i < n_valid:
                dst[0, t0 + i, head, j] = src[i, j]


def intra_chunk_program(H: int, HV: int, dtype: str = "bfloat16", K: int = 128, V: int = 128):
    """The TileLang prim_func for (H, HV, dtype). Token count, sequence count and chunk count are symbolic."""
    # ---- tile shapes (fixed by the algebra at K = V = 128) ----
    C = CHUNK        # chunk length: rows of every tile; A and T are C x C
    BLK = 16         # diagonal block of the solve: forward substitution on CUDA cores, one thread per column
    NBLK = C // BLK  # 4 diagonal blocks -> N is nilpotent of order 4
    THREADS = 128    # one warpgroup: every gemm is M = 64 (one wgmma row block); 64 x 128 fp32 = 64 regs/thread
    accum = "float32"
    assert HV % H == 0 and K == 128 and V == 128
    GROUP = HV // H  # GVA: value head hv reads q/k head hv // GROUP

    num_tokens = T.dynamic("num_tokens")
    num_seqs = T.dynamic("num_seqs")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def gdn_intra_chunk(
        k: T.Tensor((1, num_tokens, H, K), dtype),
        g: T.Tensor((1, num_tokens, HV), accum),
        beta: T.Tensor((1, num_tokens, HV), accum),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        chunk_indices: T.Tensor((num_chunks, 2), "int32"),
        a: T.Tensor((1, num_tokens, HV, C), dtype),
        gamma: T.Tensor((HV, num_chunks, C), accum),
    ):
        with T.Kernel(num_chunks, HV, threads=THREADS) as (bc, hv):
            hk = hv // GROUP
            seq = chunk_indices[bc, 0]
            bos = cu_seqlens[seq]
            eos = cu_seqlens[seq + 1]
            t0 = bos + chunk_indices[bc, 1] * C
            n_valid = T.min(eos - t0, C)  # rows of this chunk inside the sequence (1..64)

            # K's tile (a TMA destination), dead after K K^T: TileLang's merge of shared buffers by lifetime
            # lets the solve's tiles reuse its bytes
            k0_s = T.alloc_shared((C, K), dtype)
            tb_s = T.alloc_shared((C, C), dtype)      # Tb = T diag(beta) in bf16, the source of its TMA store
            g_s = T.alloc_shared((C,), accum)         # g, then gamma = its chunk-local cumsum
            b_s = T.alloc_shared((C,), accum)
            # fp32 64x64 tiles of the solve (4 x 16 KB)
            x_s = T.alloc_shared((C, C), accum)       # A (diagonal blocks read by the substitution), then I - N
            yT_s = T.alloc_shared((C, C), accum)      # Aoff^T, then N^T, then (I + N N)^T
            n_s = T.alloc_shared((C, C), accum)       # N, then P = (I - N)(I + N N)
            dinvT_s = T.alloc_shared((C, C), accum)   # Dinv^T (block diagonal)
            col = T.alloc_local((BLK,), accum)

            a_f = T.alloc_fragment((C, C), accum)     # A (bf16 wgmma accumulator layout)
            sq = T.alloc_fragment((C, C), accum)      # N, N N, P, T, Tb in turn (tf32 gemm accumulator layout)

            tx = T.get_thread_binding()

            # ---- loads: the K tile by TMA on an mbarrier (every thread arrives, one elected thread posts the
            # byte count), g and beta masked to the valid rows meanwhile ----
            loaded = T.alloc_barrier(arrive_count=THREADS)
            T.tma_copy(k[0, t0:t0 + C, hk, 0:K], k0_s, barrier=loaded)
            T.barrier_arrive(loaded)
            for i in T.Parallel(C):
                g_s[i] = T.if_then_else(i < n_valid, g[0, t0 + i, hv], 0.0)
                b_s[i] = T.if_then_else(i < n_valid, beta[0, t0 + i, hv], 0.0)
            T.cumsum(src=g_s, dim=0)
            T.barrier_wait(loaded, 0)

            # ---- A = strictly_lower(diag(beta) (K K^T (.) D)); the mask is applied before the exp ----
            T.gemm(k0_s, k0_s, a_f, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(C, C):
                a_f[i, j] = T.if_then_else(i > j, a_f[i, j] * b_s[i] * T.exp(g_s[i] - g_s[j]), 0.0)
            for i, j in T.Parallel(C, C):
                x_s[i, j] = a_f[i, j]
                # Aoff^T: A without its diagonal blocks, transposed (right operand of N = Dinv Aoff)
                yT_s[j, i] = T.if_then_else(i // BLK == j // BLK, 0.0, a_f[i, j])
                dinvT_s[i, j] = 0.0
            T.sync_threads()

            # ---- diagonal blocks: Dinv_bb = (I + A_bb)^-1 by forward substitution, one thread per column ----
            # thread tx < 64 solves (I + A_bb) x = e_c for block bb = tx // 16, column c = tx % 16
            if tx < NBLK * BLK:
                bb = tx // BLK
                c = tx % BLK
                for r in T.unroll(BLK):
                    col[r] = T.if_then_else(r == c, 1.0, 0.0)
                    for m in T.unroll(r):
                        col[r] = col[r] - x_s[bb * BLK + r, bb * BLK + m] * col[m]
                for r in T.unroll(BLK):
                    dinvT_s[bb * BLK + c, bb * BLK + r] = col[r]  # stored transposed: Dinv[r, c]
            T.sync_threads()

            # ---- T = (I - N)(I + N N) Dinv with N = Dinv Aoff: four 64x64x64 tf32 gemms ----
            # T.gemm(X, Y^T, transpose_B=True) = X @ Y: right operands live transposed (K-major, as tf32
            # needs); the left operand of the first product is Dinv itself, rebuilt from Dinv^T.
            for i, j in T.Parallel(C, C):
                n_s[i, j] = dinvT_s[j, i]
            T.gemm(n_s, yT_s, sq, transpose_B=True, clear_accum=True)          # sq = N
            for i, j in T.Parallel(C, C):
                n_s[i, j] = sq[i, j]
                yT_s[j, i] = sq[i, j]
                x_s[i, j] = T.if_then_else(i == j, 1.0, 0.0) - sq[i, j]         # I - N
            T.gemm(n_s, yT_s, sq, transpose_B=True, clear_accum=True)          # sq = N N
            for i, j in T.Parallel(C, C):
                yT_s[j, i] = T.if_then_else(i == j, 1.0, 0.0) + sq[i, j]       # (I + N N)^T
            T.gemm(x_s, yT_s, sq, transpose_B=True, clear_accum=True)          # sq = P = (I - N)(I + N N)
            T.copy(sq, n_s)
            T.gemm(n_s, dinvT_s, sq, transpose_B=True, clear_accum=True)       # sq = T = P Dinv
            for i, j in T.Parallel(C, C):
                sq[i, j] = sq[i, j] * b_s[j]                                    # Tb = T diag(beta)
            # staged in tb_s for every chunk: a tail chunk stores its rows from there as 16-byte vectors
            T.copy(sq, tb_s)
            _store_rows(tb_s, a, t0, hv, n_valid)

            # every row (past n_valid gamma stays at the chunk's last value; the state pass never reads it)
            for i in T.Parallel(C):
                gamma[hv, bc, i] = g_s[i]

    return gdn_intra_chunk
