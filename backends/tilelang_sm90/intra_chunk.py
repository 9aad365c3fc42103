"""Per (chunk, value head), in parallel over all chunks: the state-independent half of the chunked forward
(docs/algorithm.md section 2), as one TileLang kernel for sm90:

    gamma = chunk-local cumsum of g                          (fp32, CUDA cores)
    A     = strictly_lower( diag(beta) (K K^T (.) D) )       (K K^T on wgmma, bf16 operands, fp32 accumulator)
    T     = (I + A)^-1                                       (fp32, a two-level block inverse: see below)
    Tb    = T diag(beta)                                     (written in the inputs' dtype, [1, T, HV, 64])

The state pass makes the new values from Tb on chip, U = Tb (V - diag(Gamma) K S) (state_output_narrow.py), so
W = T diag(beta Gamma) K and U' = T diag(beta) V are not written for it: per chunk and value head Tb is
8 KB where W and U' were 32 KB written here and read back there (16/64 1x32768: ~1.07 GB each way).

gamma is written as [HV, num_chunks, 64] fp32 (natural log, one row per entry of the chunk table, so the
state pass loads a chunk's 64 values with one TMA box whose start is row-aligned. A token-contiguous gamma
read at a sequence's own offset puts an unaligned start in the box's innermost dimension, and that TMA load
raised "illegal instruction" on the H200 for every sequence that does not start at a multiple of 64 tokens.)

The solve, in two levels of a block-triangular inverse (exact algebra):
    level 0  D_b = (I + A_bb)^-1 for the four 16 x 16 diagonal blocks: forward substitution on CUDA cores,
             one thread per column
    level 1  T32_p = [[D_2p, 0], [L_p, D_2p+1]], L_p = -D_2p+1 A_2p+1,2p D_2p: two 16 x 16 x 16 products
             per p on CUDA cores (fp32)
    level 2  T = [[T32_0, 0], [L, T32_1]], L = -T32_1 A[32:64, 0:32] T32_0: two 32 x 32 x 32 products on
             tf32 tensor cores (mma.sync; ~1e-3 relative, below the bf16 rounding Tb gets)
The tiles are small fp32 blocks (16 x 20 padded, 32 x 32), ~25 KB in all with K's tile: a 64 x 64 form of
the same solve (four 64 x 64 x 64 tf32 products through 16 KB tiles, several stored transposed) moved
~0.5 MB of shared memory per chunk and kept the L1/shared pipe 86% busy (ncu, H200).

One warpgroup per CTA; the other CTAs on the SM hide each one's serial steps. Full chunks of Tb leave
through shared memory and one TMA store.

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


@T.macro
def _assemble_t(dst, b_s, t32a_s, m32_s, t32b_s, tx, vals, scaled):
    """dst = T diag(beta) (scaled) or T, from the solve's three 32 x 32 blocks: [[T32_0, 0], [L, T32_1]]. Each
    thread writes 16-byte pieces of whole 128-byte rows (eight lanes a row) and reads only the block its piece
    comes from (the condition is the same for the piece's eight entries); all its pieces are read (into vals)
    before the first is stored, since the compiler keeps shared loads after earlier shared stores."""
    H32 = t32a_s.shape[0]
    C = dst.shape[0]
    PIECES = C * C // 8 // 128
    for it in T.unroll(PIECES):
        r = it * 16 + tx // 8
        c0 = (tx % 8) * 8
        if r < H32:
            if c0 < H32:
                for v in T.vectorized(8):
                    vals[it, v] = t32a_s[r, c0 + v]
            else:
                for v in T.vectorized(8):
                    vals[it, v] = 0.0
        else:
            if c0 < H32:
                for v in T.vectorized(8):
                    vals[it, v] = m32_s[r - H32, c0 + v]
            else:
                for v in T.vectorized(8):
                    vals[it, v] = t32b_s[r - H32, c0 - H32 + v]
        if scaled:
            for v in T.vectorized(8):
                vals[it, v] = vals[it, v] * b_s[c0 + v]
    for it in T.unroll(PIECES):
        for v in T.vectorized(8):
            dst[it * 16 + tx // 8, (tx % 8) * 8 + v] = vals[it, v]


@T.macro
def _block_product(left, right, out, tx, sign, row4, rhs4, p4, left_blocks, right_blocks):
    """out[q] = sign * left[left_blocks[q]] @ right[right_blocks[q]] for q = 0, 1, on 16 x 16 fp32 blocks (rows
    padded), one thread per four adjacent entries of a row (128 threads: 2 x 16 rows x 4 column quads), both
    operands read as float4. out may be an operand: every read is done before the first write."""
    BLK = 16
    q = tx // 64
    i = (tx % 64) // 4
    j0 = (tx % 4) * 4
    lb = T.if_then_else(q == 0, left_blocks[0], left_blocks[1])
    rb = T.if_then_else(q == 0, right_blocks[0], right_blocks[1])
    for v in T.vectorized(4):
        p4[v] = 0.0
    for m0 in T.unroll(BLK // 4):
        for v in T.vectorized(4):
            row4[v] = left[lb, i, m0 * 4 + v]
        for mm in T.unroll(4):
            for v in T.vectorized(4):
                rhs4[v] = right[rb, m0 * 4 + mm, j0 + v]
            for v in T.unroll(4):
                p4[v] = p4[v] + row4[mm] * rhs4[v]
    T.sync_threads()
    for v in T.vectorized(4):
        out[q, i, j0 + v] = sign * p4[v]
    T.sync_threads()


def intra_chunk_program(H: int, HV: int, dtype: str = "bfloat16", emit_t: bool = False, K: int = 128,
                        V: int = 128, emit_bound: bool = False):
    """The TileLang prim_func for (H, HV, dtype). Token count, sequence count and chunk count are symbolic.
    emit_t (training): also write T itself to `tm` ([1, T, HV, 64], the backward's dbeta needs T where beta
    is 0); otherwise `tm` is a 1-element placeholder that the kernel never touches.
    emit_bound (the chained and wide routes): also write, per chunk-table row and value head, the decay bound's
    log summed over the chunk's tokens, sum_t g_t + log max(1, |1 - beta_t ||k_t||^2|) (lead_in.py's bound), to
    `bound` ([num_chunks, HV] fp32), which the walks' search then reads instead of loading K again
    (lead_in_bound._row_bounds_kernel: 0.032 ms of 16/64 1x32768's forward). beta_t ||k_t||^2 is the diagonal
    of diag(beta) K K^T, kept in A's diagonal blocks; the chunk's sum of g is gamma at its last row."""
    # ---- tile shapes (fixed by the algebra at K = V = 128) ----
    C = CHUNK        # chunk length: rows of every tile; A and T are C x C
    BLK = 16         # diagonal block of the solve: forward substitution on CUDA cores, one thread per column
    NBLK = C // BLK  # 4 diagonal blocks
    H32 = 2 * BLK    # the 32 x 32 blocks of the second level
    PAD = 20         # the solve's fp32 rows (see the tiles below)
    THREADS = 128    # one warpgroup: every gemm is M = 64 (one wgmma row block); 64 x 128 fp32 = 64 regs/thread
    accum = "float32"
    assert HV % H == 0 and K == 128 and V == 128
    GROUP = HV // H  # GVA: value head hv reads q/k head hv // GROUP

    num_tokens = T.dynamic("num_tokens")
    num_seqs = T.dynamic("num_seqs")
    num_chunks = T.dynamic("num_chunks")
    TM_SHAPE = (1, num_tokens, HV, C) if emit_t else (1, 1, 1, 1)
    BOUND_SHAPE = (num_chunks, HV) if emit_bound else (1, 1)

    @T.prim_func
    def gdn_intra_chunk(
        k: T.Tensor((1, num_tokens, H, K), dtype),
        g: T.Tensor((1, num_tokens, HV), accum),
        beta: T.Tensor((1, num_tokens, HV), accum),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        chunk_indices: T.Tensor((num_chunks, 2), "int32"),
        a: T.Tensor((1, num_tokens, HV, C), dtype),
        gamma: T.Tensor((HV, num_chunks, C), accum),
        tm: T.Tensor(TM_SHAPE, dtype),
        bound: T.Tensor(BOUND_SHAPE, accum),
    ):
        with T.Kernel(num_chunks, HV, threads=THREADS) as (bc, hv):
            # eight programs an SM (64 registers, no spills; ~21 KB of shared memory each) where registers
            # allowed five: the kernel is bound by the shared-memory pipe, and more programs fill the time each
            # spends waiting for its gates, its K tile and its load-store latencies
            T.annotate_min_blocks_per_sm(8)
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
            kd_s = T.alloc_shared((C,), accum)        # the bound's log terms (emit_bound)
            bsum = T.alloc_var(accum)
            # fp32 tiles of the solve, small and padded: rows of 20 floats (16-byte aligned, so rows load as
            # float4, and eight rows start in eight different bank quads, so the accumulator's stores of eight
            # rows at once do not conflict); D's blocks 20 rows apart (400 floats: 16 banks), so level 0's two
            # blocks a warp writes fall in opposite halves of the banks
            a16_s = T.alloc_shared((NBLK, BLK, PAD), accum)       # A's diagonal blocks
            d16_s = T.alloc_shared((NBLK, PAD, PAD), accum)       # their inverses D_b
            o16_s = T.alloc_shared((2, BLK, PAD), accum)          # A_10, A_32; then A D; then L_0, L_1
            a32_s = T.alloc_shared((H32, H32), accum)             # A[32:64, 0:32]
            t32a_s = T.alloc_shared((H32, H32), accum)            # T[0:32, 0:32]
            t32b_s = T.alloc_shared((H32, H32), accum)            # T[32:64, 32:64]
            m32_s = T.alloc_shared((H32, H32), accum)             # A[32:64, 0:32] T[0:32, 0:32], then T[32:64, 0:32]
            col = T.alloc_local((BLK,), accum)
            row4 = T.alloc_local((4,), accum)   # levels 0 and 1: four entries of a left operand's row
            rhs4 = T.alloc_local((4,), accum)   # ... and of a right operand's row
            p4 = T.alloc_local((4,), accum)     # ... and of the product's
            t8a = T.alloc_local((8,), accum)    # a thread's entries of T32_0 and T32_1, read before they are stored
            t8b = T.alloc_local((8,), accum)
            tb32 = T.alloc_local((4, 8), accum)   # a thread's 16-byte pieces of T (or Tb) before they are stored

            a_f = T.alloc_fragment((C, C), accum)     # A (bf16 wgmma accumulator layout)
            p32 = T.alloc_fragment((H32, H32), accum)

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

            # ---- A = strictly_lower(diag(beta) (K K^T (.) D)) ----
            T.gemm(k0_s, k0_s, a_f, transpose_B=True, clear_accum=True)
            # (emit_bound keeps the diagonal, beta_t ||k_t||^2: the substitutions read only below it in a16_s)
            # Scaled for every entry first, masked after: the loads of beta and g are then unconditional, so each
            # thread reads its 2 rows and 16 columns once (scaled under the mask, they were predicated loads per
            # entry, ~3 of 32 entries a thread: the most shared-memory requests of the kernel). The exponent is
            # capped at 80 so the entries the mask drops (i < j: g_i - g_j can be large) cannot overflow; a kept
            # entry reaches the cap only if its gates grow the state by e^80 within the chunk.
            for i, j in T.Parallel(C, C):
                a_f[i, j] = a_f[i, j] * b_s[i] * T.exp(T.min(g_s[i] - g_s[j], 80.0))
            for i, j in T.Parallel(C, C):
                a_f[i, j] = T.if_then_else((i > j) | (emit_bound and i == j), a_f[i, j], 0.0)
            # the blocks the solve reads, each written once from the accumulator
            for i, j in T.Parallel(C, C):
                if i // BLK == j // BLK:
                    a16_s[i // BLK, i % BLK, j % BLK] = a_f[i, j]
                elif i // BLK == j // BLK + 1 and (i // BLK) % 2 == 1:
                    o16_s[i // H32, i % BLK, j % BLK] = a_f[i, j]
                elif i >= H32 and j < H32:
                    a32_s[i - H32, j] = a_f[i, j]
            if emit_bound:
                for i in T.Parallel(C):
                    kd_s[i] = T.if_then_else(
                        i < n_valid, T.log(T.max(T.abs(1.0 - a16_s[i // BLK, i % BLK, i % BLK]), 1.0)), 0.0)

            # ---- level 0: D_b = (I + A_bb)^-1 by forward substitution, one thread per column of a block ----
            if tx < NBLK * BLK:
                bb = tx // BLK
                c = tx % BLK
                for r in T.unroll(BLK):
                    col[r] = T.if_then_else(r == c, 1.0, 0.0)
                    for m0 in T.unroll((r + 3) // 4):   # row r of the block read four floats at a time
                        for v in T.vectorized(4):
                            row4[v] = a16_s[bb, r, m0 * 4 + v]
                        for mm in T.unroll(4):
                            if m0 * 4 + mm < r:
                                col[r] = col[r] - row4[mm] * col[m0 * 4 + mm]
                for r in T.unroll(BLK):
                    d16_s[bb, r, c] = col[r]

            # ---- level 1: the 32 x 32 diagonal blocks, T32_p = [[D_2p, 0], [L_p, D_2p+1]] with
            # L_p = -D_2p+1 A_2p+1,2p D_2p (two 16 x 16 x 16 products per p, on CUDA cores). Each thread makes
            # four adjacent entries of a row, reading both operands four floats at a time: the shared-memory pipe
            # bounds this kernel (ncu), and one product entry per thread read two floats per FMA ----
            _block_product(o16_s, d16_s, o16_s, tx, 1.0, row4, rhs4, p4, left_blocks=(0, 1), right_blocks=(0, 2))
            _block_product(d16_s, o16_s, o16_s, tx, -1.0, row4, rhs4, p4, left_blocks=(1, 3), right_blocks=(0, 1))
            # the 32 x 32 blocks written a row per warp: 32 lanes on 32 columns, one bank each under the tf32
            # operands' swizzle (a thread per four columns put four lanes on every bank). Every entry is read
            # before the first is written: the compiler cannot move a shared load above a shared store (one
            # buffer), so load-store pairs ran one load latency each (ncu: ~20% of the stall samples)
            j = tx % H32
            for it in T.unroll(H32 * H32 // THREADS):
                i = it * (THREADS // H32) + tx // H32
                t8a[it] = T.if_then_else(i // BLK == j // BLK, d16_s[i // BLK, i % BLK, j % BLK],
                                         T.if_then_else(i > j, o16_s[0, i % BLK, j % BLK], 0.0))
                t8b[it] = T.if_then_else(i // BLK == j // BLK, d16_s[2 + i // BLK, i % BLK, j % BLK],
                                         T.if_then_else(i > j, o16_s[1, i % BLK, j % BLK], 0.0))
            for it in T.unroll(H32 * H32 // THREADS):
                i = it * (THREADS // H32) + tx // H32
                t32a_s[i, j] = t8a[it]
                t32b_s[i, j] = t8b[it]

            # ---- level 2: T = [[T32_0, 0], [-T32_1 A[32:64, 0:32] T32_0, T32_1]] (two 32 x 32 x 32 tf32 gemms) ----
            T.gemm(a32_s, t32a_s, p32, clear_accum=True)
            T.copy(p32, m32_s)
            T.gemm(t32b_s, m32_s, p32, clear_accum=True)
            for i, j in T.Parallel(H32, H32):
                m32_s[i, j] = -p32[i, j]
            # Tb = T diag(beta), assembled from the three blocks, staged in tb_s for every chunk (a tail chunk
            # stores its rows from there as 16-byte vectors)
            _assemble_t(tb_s, b_s, t32a_s, m32_s, t32b_s, tx, tb32, scaled=True)
            _store_rows(tb_s, a, t0, hv, n_valid)
            if emit_t:  # T itself, through the same staging tile once Tb has left it
                T.sync_threads()
                _assemble_t(tb_s, b_s, t32a_s, m32_s, t32b_s, tx, tb32, scaled=False)
                _store_rows(tb_s, tm, t0, hv, n_valid)

            # every row (past n_valid gamma stays at the chunk's last value; the state pass never reads it)
            for i in T.Parallel(C):
                gamma[hv, bc, i] = g_s[i]
            if emit_bound:  # a fixed tree over one warp (pairs, then shuffles): the same bits on every run
                if tx < 32:
                    bsum = kd_s[2 * tx] + kd_s[2 * tx + 1]
                    for lvl in T.unroll(5):
                        bsum = bsum + T.shfl_xor(bsum, 16 >> lvl)
                    if tx == 0:
                        bound[bc, hv] = g_s[n_valid - 1] + bsum

    return gdn_intra_chunk
