"""The backward's reverse pass fused with the per-chunk gradients (docs/sm90-design.md): per (sequence
or segment, value head), the chunks right to left with dS [K, V] fp32 in one warpgroup's registers; nothing of the
chain (dS_end, dU, dX) leaves the chip. Per chunk, from S0 and X (both from the forward's state pass run again,
forward.entering_states_and_x), Tb, T, gamma, beta, Q, K and dO, with P = s Q K^T (.) D_incl:

    X   = V - diag(Gamma) K S0,   U = Tb X
    dU  = diag(Gamma_C / Gamma) K dS_end + P^T dO,   dX = Tb^T dU  (= dV)
    dS0 = Gamma_C dS_end + Q^T (s diag(Gamma) dO) - K^T (diag(Gamma) dX)
    dq  = diag(s Gamma) dO S0^T + dPD K,   dPD = s dO U^T (.) D_incl
    dk  = diag(Gamma_C / Gamma) U dS_end^T - diag(Gamma) dX S0^T + dPD^T Q + (H + H^T) K
    dTb = dU X^T -> dT = dTb diag(beta) -> M = T^T dT -> dA = strictly_lower(-M T^T) -> H = diag(beta) dA (.) D
    dbeta, dgamma (then dg, its reverse cumsum) term for term as chunk_grads.py

Four warpgroups, each with its own register budget (setmaxnreg; OWNER_REGS ... G_REGS below, summing to 512):

    owner (threads   0-127)  dS: hands bf16 dS_end over, dS <- Gamma_C dS (and Gamma_C <S0, dS_end> for g's dg
                             from its registers), scales dO's tile in place to
                             s diag(Gamma) dO once every other role has read it, dS += Q^T (that), then
                             dS += K^T (-Gamma dX) when x hands it over; then the TMA loads of the next chunk,
                             each tile once its last readers are done
    x     (threads 128-255)  the chain's other half: U = Tb X before dS_end arrives, then
                             dU = (Gamma_C / Gamma) K dS_end + P^T dO, dX = Tb^T dU -> -Gamma dX for the owner
                             and g; then, while the owner closes the chain, most of the solve's backward from dU
                             (dT, M, then M T^T: dA (.) D and H's lower triangle) and dv
    p     (threads 256-383)  the 64 x 64 work that needs no dS: P, dPD, and dgamma's P terms (the rows of
                             P (.) dP minus its columns); then the rest of the solve's: dbeta's X dU^T term, K K^T,
                             dq (dPD K added to g's term), and once x has written dA (.) D and H, the A terms of
                             dbeta and dgamma with K K^T (H's tile read transposed for the columns)
    g     (threads 384-511)  dq's diag(s Gamma) dO S0^T (left in dq's slot for p), then dk (one [64, 128]
                             accumulator), dgamma's O, X and state terms from the accumulator's rows against Q
                             or K, and dg

The products a chunk (units of 64 x 64 x 64 MACs): owner 8, x 16 (dX twice: for the chain, then for dv's
store), p 10 (K K^T again), g 18 (H K, and H^T K from the same tile read transposed by the tensor cores). dgamma's
column term needs no products of its own (s (U dO^T) (.) (K Q^T) (.) D^T and a masked pass): its rows are the
columns of the P (.) dP p holds for the row term (column_sums). x does not make X = V - diag(Gamma) K S0 (a 4-unit
product and a pass over V's tile) on the chain: the recompute of S0 makes X anyway and leaves it in dV's buffer
(each chunk's X is read by the chunk's first loads, its dV stored at the chunk's end: the same rows, one
program's), so x starts at U. The solve's backward is split between x and p: given wholly to p, after its P work,
p paced every chunk (clock64 trace, 16/32 1x32768: p's last barrier ~39700 clocks into a ~49300-clock step, x idle
from ~15800); wholly in x it paced the step the same way (~45400 clocks). Single-slot tiles, each reloaded for the
next chunk by the owner once its last readers are done (no chunk-wide barrier: the roles' tails overlap the next
chunk's loads).

dq and dk leave per chunk and value head (bf16, all 64 rows: dqk[chunk, hv] holds dq's, then dk's, each in the
order of a [64, 128] wgmma accumulator, group_sum.slot_offset: 16-byte stores by the threads; dq's
slot first holds g's term, which p reads back, and so dq is rounded to bf16 twice), the host summing
each key head's group in a fixed order (bitwise repeatable). dqk[chunk, hv] is 32 KB, S0's size: the host
passes S0's own buffer, each slot taken over once the chunk's S0 has landed from it (nothing reads it again), so
the per-value-head gradients need no memory of their own (-256 MB of peak at 16/32 1x32768).

Barriers, each completed once a chunk (ready: parity i % 2; free: the previous chunk's, parity (i % 2) ^ 1):
    loaded (the owner's loads but K's)         ds_ready (owner)  ds_free (x, g)
    k_loaded (the owner's load of K)
    u_ready (x)         u_free (p, g)          p_ready (p)       do_read (x, p, g: raw dO read)
    dq_part (g: dq's dO S0^T term stored in dq's slot, for p)
    gx_ready (x)        gx_free (g: its product has read the tile; the owner's read precedes its next ds_ready)
    pd_ready (p)        pd_free (g, p: their products with dPD and with K are done)
    du_ready (x)        du_free (p)            m_ready (x: M in P's tile, its last read of X)
    s0_free (g: its last product has read S0)  tb_free (x: its last product has read Tb)
    q_free (g: its dPD^T Q is done)            tot_ready (owner: Gamma_C <S0, dS_end> for g's tail; g waits
                                               for it before its own warpgroup-wide sum, the two sharing
                                               hardware barriers 1 and 2)
    h_ready (x: dA (.) D in P's tile, H, and its last reads of K, T and the gates)
    tg_read (p: its last reads of T and the gates, and of beta)
    gp_ready (p: dbeta's and dgamma's terms)
    h_free (g: its tail has read H and p's per-row terms)

Rows past a sequence's end inside the last chunk are the next sequence's (or TMA's zeros past the tensor): the
per-row factors are 0 there (Gamma, Gamma_C / Gamma, s Gamma, beta), and P, dPD, D and the dT rows are masked.
X's rows there (the next sequence's X, or its dV once that program has stored it) are zeroed in the tile.
"""
import tilelang
import tilelang.language as T

from .group_sum import accumulator_thread, slot_offset
from .sequence_macros import sequence_bounds

CHUNK = 64
THREADS = 512
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
                tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}
# registers per thread of each role (setmaxnreg; a role starts at 65536 / 512 = 128 and raises or lowers it), so
# the four sum to 512. x holds its [64, 128] accumulator or the solve's 64 x 64 one (the A terms' rows are p's), p two
# 64 x 64 ones, then K K^T beside dq's [64, 128] accumulator, g its [64, 128] accumulator and a [64, 128]
# temporary for the row dots. x, whose block ends the chunk's chain, needs more than its products' share (H200,
# backward-only profile: taking 8 of g's, kernel 1.548 -> 1.471 ms at 16/32 1x32768, x's spill stores / loads
# 43 / 63 -> 25 / 30 in ptxas' report). With dq's dPD K and K K^T held in p: 160 / 96 / 144 / 112 against
# 160 / 112 / 136 / 104 and 160 / 104 / 144 / 104, one device run: kernel 1.2625 / 1.3018 / 1.3163 ms at 16/32
# 1x32768, 0.3257 / 0.3423 / 0.3365 at 16/32 1x8192 (spill stores / loads: p 4 / 11, x 15 / 20, g 7 / 16 at the
# first; docs/performance.md)
OWNER_REGS, X_REGS, P_REGS, G_REGS = 160, 96, 144, 112


def backward_fused_program(H: int, HV: int, dtype: str = "bfloat16", has_dinit: bool = False,
                           store_dh0: bool = False, K: int = 128, V: int = 128):
    """dinit: each program's dS_end at its last chunk (the sequence's dht, or the segment's from the routes in
    backward.py); dh0: dS at its first chunk's start."""
    C = CHUNK
    accum = "float32"
    assert HV % H == 0 and K == 128 and V == 128
    assert OWNER_REGS + X_REGS + P_REGS + G_REGS == 512
    GROUP = HV // H

    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_seqs = T.dynamic("num_seqs")
    num_dinit = T.dynamic("num_dinit")
    num_dh0 = T.dynamic("num_dh0")

    # The loads of chunk i + 1 leave as their tiles' last readers of chunk i are done, each adding its bytes to
    # `loaded` (whose phase for chunk i + 1 is open once every role has waited for chunk i's). The owner, idle
    # after its second product, issues them all: dO (its own product is dO's last reader), S0 and X (m_ready,
    # du_free, s0_free), Q (q_free), T and the gates (h_ready, tg_read: only x and p read them late), Tb
    # (tb_free), whose macro's arrival of its 128 threads closes the phase; then K (pd_free: g's products with H,
    # p's dPD K) on a barrier of its own, k_loaded: the roles start a chunk on `loaded` and wait for K
    # only where they first read it (x before K dS_end, p before Q K^T, g before its first row dot against K, the
    # owner before its K^T product), so x's U and the owner's hand-over of dS_end run while K, issued last, is
    # still landing. Both barriers complete once a chunk (parity i % 2); K's next load follows every role's K wait
    # of this chunk.
    # Issued by x between its own products, they made x ~2000 clocks slower a chunk; behind a barrier of all 512
    # threads at the chunk's end they cost ~3300 clocks from it to the next chunk; T, the gates and Q waiting with
    # K for g's last products landed later than their readers needed (docs/performance.md, the fused kernel).
    # The tiles a program reads once (dO, S0, X, Tb and T; not Q and K, which both value heads of a key head read)
    # and dV's store carry L2's evict-first hint, so that L2 keeps what is read again: Q and K, and dq's slot, which
    # g stores and p reads back (H200, docs/performance.md: fused kernel 338 -> 313 us at 4/8 1x32768, 95 -> 92 at 4/8
    # 1x8192, the same at 16/32; gradients bitwise equal). Every request added to the kernel's own has cost more
    # than it brought: L2 prefetches of the next chunk's tiles, by lines or by bulk copies, +3% to +42%
    once = "evict_first"

    def chunk_of(n_chunks, i):
        """Step i's chunk within its run (chunks right to left)."""
        return n_chunks - 1 - i

    def rows(bos, n_chunks, i):
        """Step i's chunk as a token slice of the run starting at bos."""
        t0 = bos + chunk_of(n_chunks, i) * C
        return slice(t0, t0 + C)

    @T.macro
    def load_do(do, do_s, loaded, bos, n_chunks, hv, i):
        T.tma_copy(do[0, rows(bos, n_chunks, i), hv, 0:V], do_s, barrier=loaded, eviction_policy=once)

    @T.macro
    def load_s0_x(hs, xv, s0_s, x_s, loaded, bos, c0, n_chunks, hv, i):
        T.tma_copy(hs[c0 + chunk_of(n_chunks, i), hv, 0:K, 0:V], s0_s, barrier=loaded, eviction_policy=once)
        T.tma_copy(xv[0, rows(bos, n_chunks, i), hv, 0:V], x_s, barrier=loaded, eviction_policy=once)

    @T.macro
    def load_tb(a, tb_s, loaded, bos, n_chunks, hv, i):
        """The last load on `loaded`, and the owner's arrival that closes its phase."""
        T.tma_copy(a[0, rows(bos, n_chunks, i), hv, 0:C], tb_s, barrier=loaded, eviction_policy=once)
        T.barrier_arrive(loaded)

    @T.macro
    def load_t_gates(tm, gamma, t_s, g_s, loaded, bos, c0, n_chunks, hv, i):
        T.tma_copy(tm[0, rows(bos, n_chunks, i), hv, 0:C], t_s, barrier=loaded, eviction_policy=once)
        T.tma_copy(gamma[hv, c0 + chunk_of(n_chunks, i), 0:C], g_s, barrier=loaded)

    @T.macro
    def load_q(q, q_s, loaded, bos, n_chunks, hk, i):
        T.tma_copy(q[0, rows(bos, n_chunks, i), hk, 0:K], q_s, barrier=loaded)

    @T.macro
    def load_k(k, k_s, k_loaded, bos, n_chunks, hk, i):
        """The chunk's last load, on k_loaded, and the owner's arrival that closes its phase."""
        T.tma_copy(k[0, rows(bos, n_chunks, i), hk, 0:K], k_s, barrier=k_loaded)
        T.barrier_arrive(k_loaded)

    @T.macro
    def landed(loaded, bos, eos, n_chunks, i):
        """Chunk i counted from the run's end, once its tiles have landed: (its barrier parity, first token, rows
        inside the sequence). Every role starts its step here."""
        t0 = rows(bos, n_chunks, i).start
        T.barrier_wait(loaded, i % 2)
        return i % 2, t0, T.min(eos - t0, C)

    @T.macro
    def store_rows(acc, stage, out, t0, hv, n_valid):
        """dv: a chunk's [C, 128] rows of acc into out[0, t0:, hv, :] through the free tile `stage`: a full chunk by one
        TMA store, a tail chunk's valid rows by threads (a box would overwrite the next sequence's). The elected
        thread waits for the store to have read the tile before it goes on."""
        T.copy(acc, stage)
        T.fence_proxy_async()
        if n_valid == C:
            T.copy(stage, out[0, t0:t0 + C, hv, 0:128], eviction_policy=once)
        else:
            for r, j in T.Parallel(C, 128):
                if r < n_valid:
                    out[0, t0 + r, hv, j] = stage[r, j]

    @T.macro
    def store_slot(acc, dqk, c, hv, which):
        """dq (which 0) or dk (1) of a chunk into its slot, all 64 rows (a tail's past the sequence too: the slot is
        this program's), in the order of the [64, 128] accumulator acc (g's or p's): 16-byte stores
        (group_sum.slot_offset says why)."""
        for r, j in T.Parallel(C, K):
            f = slot_offset(r, j)
            dqk[c, hv, which, f // K, f % K] = T.cast(acc[r, j], dtype)

    @T.macro
    def add_slot(acc, dqk, c, hv):
        """acc += dq's slot as store_slot left it from another role's accumulator of the same shape: each thread reads
        the elements its counterpart stored (the caller waits for the barrier the storing role arrives at after
        its stores: an mbarrier's arrive releases and its wait acquires, at the block's scope)."""
        for r, j in T.Parallel(C, K):
            f = slot_offset(r, j)
            acc[r, j] = acc[r, j] + T.cast(dqk[c, hv, 0, f // K, f % K], accum)

    @T.macro
    def masked(keep, value, g_s, hi, lo):
        """value * exp(g_hi - g_lo) where keep, else 0, without a branch: the selects take cheap operands and the
        exponential runs on 0 where not kept (a select around the exponential itself is lowered to a branch per
        element: 192 divergent regions a chunk in p's SASS)."""
        return T.if_then_else(keep, value, 0.0) * T.exp(T.if_then_else(keep, g_s[hi] - g_s[lo], 0.0))

    @T.macro
    def row_dot(acc, m_s, tmp, out):
        """out = the rows of acc (.) m_s (a [C, V] bf16 tile) through tmp, as acc is still needed. (A [C, V / 2]
        temporary taken twice takes acc's layout, half of it never written, and its reduction read that half.)"""
        for r, j in T.Parallel(C, V):
            tmp[r, j] = acc[r, j] * m_s[r, j]
        T.reduce_sum(tmp, out, dim=1)

    @T.macro
    def column_sums(f, part, cs):
        """cs[w, c] = the sum over warp w's 16 rows of column c of f (a [C, C] wgmma accumulator of one warpgroup),
        the caller adding the four warps'. Thread t holds rows t // 32 * 16 + t % 32 // 4 (+ 8) and columns
        8 n + t % 4 * 2 (+ 1): its two rows into part[t, :] (thread-local), the 8 lanes of a column summed by
        shuffles, one lane each written. TileLang's reduce_sum over dim 0 takes hardware barriers 1 and 2 and a
        workspace shared with the owner's and g's reductions (a race, once their
        timing moved); this needs no barrier but p's
        own (TileLang syncs p's 128 threads between the tile's writes and reads)."""
        T.clear(part)
        for r, c in T.Parallel(C, C):
            part[accumulator_thread(r, c), c // 8 * 2 + c % 2] += f[r, c]
        for t, v in T.Parallel(128, 16):
            part[t, v] += T.shfl_xor(part[t, v], 4)
        for t, v in T.Parallel(128, 16):
            part[t, v] += T.shfl_xor(part[t, v], 8)
        for t, v in T.Parallel(128, 16):
            part[t, v] += T.shfl_xor(part[t, v], 16)
        for t, v in T.Parallel(128, 16):
            if t % 32 < 4:
                cs[t // 32, v // 2 * 8 + t % 4 * 2 + v % 2] = part[t, v]

    @T.prim_func
    def gdn_backward_fused(
        q: T.Tensor((1, num_tokens, H, K), dtype),
        k: T.Tensor((1, num_tokens, H, K), dtype),
        xv: T.Tensor((1, num_tokens, HV, V), dtype),       # X per chunk (dv's buffer: each chunk's read first)
        do: T.Tensor((1, num_tokens, HV, V), dtype),
        a: T.Tensor((1, num_tokens, HV, C), dtype),          # Tb
        tm: T.Tensor((1, num_tokens, HV, C), dtype),         # T
        hs: T.Tensor((num_chunks, HV, K, V), dtype),         # S0 per chunk
        gamma: T.Tensor((HV, num_chunks, C), accum),
        beta: T.Tensor((1, num_tokens, HV), accum),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        chunk_offsets: T.Tensor((num_seqs + 1,), "int32"),
        dinit: T.Tensor((num_dinit, HV, K, V), accum),
        dqk: T.Tensor((num_chunks, HV, 2, C, K), dtype),     # dq, dk per chunk and value head (S0's buffer)
        dv: T.Tensor((1, num_tokens, HV, V), dtype),
        dg: T.Tensor((1, num_tokens, HV), accum),
        dbeta: T.Tensor((1, num_tokens, HV), accum),
        dh0: T.Tensor((num_dh0, HV, K, V), accum),
        scale: T.float32,
    ):
        with T.Kernel(HV, num_seqs, threads=THREADS) as (hv, n):
            hk = hv // GROUP
            bos, eos, n_chunks, c0 = sequence_bounds(cu_seqlens, chunk_offsets, n)

            # the chunk's tiles (one slot each)
            q_s = T.alloc_shared((C, K), dtype)
            k_s = T.alloc_shared((C, K), dtype)
            x_s = T.alloc_shared((C, V), dtype)       # X
            do_s = T.alloc_shared((C, V), dtype)      # dO, then s diag(Gamma) dO (owner, in place)
            tb_s = T.alloc_shared((C, C), dtype)
            t_s = T.alloc_shared((C, C), dtype)
            s0_s = T.alloc_shared((K, V), dtype)
            g_s = T.alloc_shared((C,), accum)
            # hand-overs
            ds_s = T.alloc_shared((K, V), dtype)      # bf16 dS_end: owner -> x, g
            u_s = T.alloc_shared((C, V), dtype)       # U: x -> p, g
            du_s = T.alloc_shared((C, V), dtype)      # dU (x's), then dV's staging for its TMA store
            gx_s = T.alloc_shared((C, V), dtype)      # -Gamma dX: x -> owner, g
            p_s = T.alloc_shared((C, C), dtype)       # P (p -> x), x's dT and M (P read by dU), dA (.) D (x -> p)
            pd_s = T.alloc_shared((C, C), dtype)      # dPD: p -> g
            h_s = T.alloc_shared((C, C), dtype)       # H (strictly lower): x -> g, p
            # per-row factors, one set per role (a (C,) fragment under a (C, V) loop runs on a 64-thread replica)
            sg_o = T.alloc_shared((C,), accum)        # owner: s Gamma
            eg_x = T.alloc_shared((C,), accum)        # x: Gamma
            eu_x = T.alloc_shared((C,), accum)        # x: Gamma_C / Gamma
            b_s = T.alloc_shared((C,), accum)         # x: beta (p takes a copy, bet, for its A terms)
            sg_g = T.alloc_shared((C,), accum)        # g: s Gamma
            cs_p = T.alloc_shared((4, C), accum)      # p: each warp's column sums of P (.) dP
            eu_g = T.alloc_shared((C,), accum)        # g: Gamma_C / Gamma
            dgp_s = T.alloc_shared((C,), accum)       # p -> g: dgamma's P and A terms
            dbp_s = T.alloc_shared((C,), accum)       # p -> g: dbeta's T and A terms
            tot_s = T.alloc_shared((1,), accum)       # owner -> g: Gamma_C <S0, dS_end>
            dg_s = T.alloc_shared((C,), accum)        # g: dgamma before its reverse cumsum

            dS = T.alloc_fragment((K, V), accum)      # owner
            acc_x = T.alloc_fragment((C, V), accum)   # x: U, K dS_end -> dU, dX
            f1 = T.alloc_fragment((C, C), accum)      # p
            f2 = T.alloc_fragment((C, C), accum)      # p
            row_p = T.alloc_fragment((C,), accum)
            row_q = T.alloc_fragment((C,), accum)
            dgp = T.alloc_fragment((C,), accum)
            dbp = T.alloc_fragment((C,), accum)
            bet = T.alloc_fragment((C,), accum)       # p: beta, read from b_s before tg_read (below)
            xf2 = T.alloc_fragment((C, C), accum)     # x: the solve's backward
            acc_g = T.alloc_fragment((C, K), accum)   # g: dq, then dk
            acc_p = T.alloc_fragment((C, K), accum)   # p: dq
            col_p = T.alloc_fragment((128, 16), accum)  # p: a thread's column partials (see its pass)
            tmp_g = T.alloc_fragment((C, V), accum)
            row_g = T.alloc_fragment((C,), accum)
            de_g = T.alloc_fragment((C,), accum)
            dgam = T.alloc_fragment((C,), accum)
            red = T.alloc_fragment((128, 2), accum)   # owner: <S0, dS>, two slots of each thread (see its pass)
            tot = T.alloc_fragment((1,), accum)
            carry = T.alloc_fragment((1,), accum)     # the state decay's terms summed (Gamma_C's share)
            sfx = T.alloc_fragment((C,), accum)       # g: dg, the suffix sums of dg_s
            g_last = T.alloc_var(accum)

            loaded = T.alloc_barrier(arrive_count=128)
            k_loaded = T.alloc_barrier(arrive_count=128)
            ds_ready = T.alloc_barrier(arrive_count=128)
            ds_free = T.alloc_barrier(arrive_count=256)
            u_ready = T.alloc_barrier(arrive_count=128)
            u_free = T.alloc_barrier(arrive_count=256)
            p_ready = T.alloc_barrier(arrive_count=128)
            do_read = T.alloc_barrier(arrive_count=384)
            gp_ready = T.alloc_barrier(arrive_count=128)
            du_ready = T.alloc_barrier(arrive_count=128)
            du_free = T.alloc_barrier(arrive_count=128)
            m_ready = T.alloc_barrier(arrive_count=128)
            tb_free = T.alloc_barrier(arrive_count=128)
            s0_free = T.alloc_barrier(arrive_count=128)
            tot_ready = T.alloc_barrier(arrive_count=128)
            gx_ready = T.alloc_barrier(arrive_count=128)
            gx_free = T.alloc_barrier(arrive_count=128)
            pd_ready = T.alloc_barrier(arrive_count=128)
            pd_free = T.alloc_barrier(arrive_count=256)
            h_ready = T.alloc_barrier(arrive_count=128)
            q_free = T.alloc_barrier(arrive_count=128)
            tg_read = T.alloc_barrier(arrive_count=128)
            h_free = T.alloc_barrier(arrive_count=128)
            dq_part = T.alloc_barrier(arrive_count=128)

            tx = T.get_thread_binding()
            if tx < 128:
                # ---- owner: dS in registers ----
                T.set_max_nreg(OWNER_REGS, int(OWNER_REGS > 128))   # raise, or lower, from 128
                if n_chunks > 0:
                    load_do(do, do_s, loaded, bos, n_chunks, hv, 0)
                    load_s0_x(hs, xv, s0_s, x_s, loaded, bos, c0, n_chunks, hv, 0)
                    load_t_gates(tm, gamma, t_s, g_s, loaded, bos, c0, n_chunks, hv, 0)
                    load_q(q, q_s, loaded, bos, n_chunks, hk, 0)
                    load_tb(a, tb_s, loaded, bos, n_chunks, hv, 0)
                    load_k(k, k_s, k_loaded, bos, n_chunks, hk, 0)
                # dS_end's 64 KB from global memory after the first chunk's loads are issued, so the two overlap
                # (fused kernel -0.4% to -0.7% at the quick grid's points, most where programs are short)
                if has_dinit:
                    T.copy(dinit[n, hv, 0:K, 0:V], dS)
                else:
                    T.clear(dS)
                for i in T.serial(n_chunks):
                    ph, _, n_valid = landed(loaded, bos, eos, n_chunks, i)
                    T.barrier_wait(ds_free, ph ^ 1)            # x and g have read the previous dS_end
                    T.copy(dS, ds_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(ds_ready)
                    g_last = g_s[n_valid - 1]
                    for r in T.Parallel(C):
                        sg_o[r] = T.if_then_else(r < n_valid, scale * T.exp(g_s[r]), 0.0)
                    for r, j in T.Parallel(K, V):
                        dS[r, j] = dS[r, j] * T.exp(g_last)
                    # Gamma_C <S0, dS_end> for g's dg (the state decay's gate term) from the registers, while the
                    # others read dO: each thread adds its elements of dS (.) S0 into its own two slots of red (the
                    # accumulator's element (r, j) lives in thread r % 64 // 16 * 32 + r % 8 * 4 + j % 8 // 2), one
                    # reduction across the warpgroup after. g's own pass over two shared tiles paced its chain
                    T.clear(red)
                    for r, j in T.Parallel(K, V):
                        red[r % 64 // 16 * 32 + r % 8 * 4 + j % 8 // 2, j % 2] += dS[r, j] * T.cast(s0_s[r, j], accum)
                    T.reduce_sum(T.reshape(red, (256,)), tot, dim=0, clear=True)
                    T.barrier_wait(h_free, ph ^ 1)             # g's tail has read the previous chunk's
                    tot_s[0] = tot[0]
                    T.barrier_arrive(tot_ready)
                    T.barrier_wait(do_read, ph)                 # x, p and g have read dO as loaded
                    for r, j in T.Parallel(C, V):
                        do_s[r, j] = do_s[r, j] * sg_o[r]
                    T.fence_proxy_async()
                    T.wgmma_gemm(q_s, do_s, dS, transpose_A=True)              # + Q^T s Gamma dO
                    T.wait_wgmma(0)
                    if i + 1 < n_chunks:                        # dO's last reader was that product
                        load_do(do, do_s, loaded, bos, n_chunks, hv, i + 1)
                    T.barrier_wait(gx_ready, ph)
                    T.barrier_wait(k_loaded, ph)
                    T.wgmma_gemm(k_s, gx_s, dS, transpose_A=True)              # - K^T Gamma dX
                    T.wait_wgmma(0)
                    # idle until the next chunk: it reloads S0 and X once x (before m_ready), p (du_free) and g
                    # (s0_free) have read them, Q after g's dPD^T Q (q_free), T and the gates once x's and p's
                    # passes over them are done (h_ready, tg_read), Tb after x's last product (tb_free), and K after
                    # g's products with H and p's dPD K (pd_free)
                    if i + 1 < n_chunks:
                        T.barrier_wait(m_ready, ph)
                        T.barrier_wait(du_free, ph)
                        T.barrier_wait(s0_free, ph)
                        load_s0_x(hs, xv, s0_s, x_s, loaded, bos, c0, n_chunks, hv, i + 1)
                        T.barrier_wait(q_free, ph)
                        load_q(q, q_s, loaded, bos, n_chunks, hk, i + 1)
                        T.barrier_wait(h_ready, ph)
                        T.barrier_wait(tg_read, ph)
                        load_t_gates(tm, gamma, t_s, g_s, loaded, bos, c0, n_chunks, hv, i + 1)
                        T.barrier_wait(tb_free, ph)
                        load_tb(a, tb_s, loaded, bos, n_chunks, hv, i + 1)
                        T.barrier_wait(pd_free, ph)
                        load_k(k, k_s, k_loaded, bos, n_chunks, hk, i + 1)
                if store_dh0:
                    T.copy(dS, dh0[n, hv, 0:K, 0:V])
            elif tx < 256:
                # ---- x: U, then the chain's dU and dX; then its share of the solve's backward and dv ----
                T.set_max_nreg(X_REGS, int(X_REGS > 128))   # raise, or lower, from 128
                for i in T.serial(n_chunks):
                    ph, t0, n_valid = landed(loaded, bos, eos, n_chunks, i)
                    g_last = g_s[n_valid - 1]
                    for r in T.Parallel(C):
                        eg_x[r] = T.if_then_else(r < n_valid, T.exp(g_s[r]), 0.0)
                        eu_x[r] = T.if_then_else(r < n_valid, T.exp(g_last - g_s[r]), 0.0)
                        b_s[r] = T.if_then_else(r < n_valid, beta[0, t0 + r, hv], 0.0)
                    if n_valid < C:   # a tail chunk: X's rows past the sequence (see the docstring) to 0
                        for r, j in T.Parallel(C, V):
                            if r >= n_valid:
                                x_s[r, j] = T.cast(0.0, dtype)
                        T.fence_proxy_async()
                    T.clear(acc_x)   # a new live range (see the dv store's)
                    # each pass below leaves its tile by a whole-fragment copy (stmatrix): TileLang puts a
                    # 128-thread barrier in every step of an element loop that writes a shared tile it also reads,
                    # and writes a scalar per element where a loop mixes element math and stores
                    T.wgmma_gemm(tb_s, x_s, acc_x, clear_accum=True)               # U = Tb X
                    T.wait_wgmma(0)
                    for r, j in T.Parallel(C, V):
                        acc_x[r, j] = T.if_then_else(r < n_valid, acc_x[r, j], 0.0)
                    T.barrier_wait(u_free, ph ^ 1)
                    T.copy(acc_x, u_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(u_ready)
                    T.barrier_wait(ds_ready, ph)
                    T.barrier_wait(k_loaded, ph)
                    T.wgmma_gemm(k_s, ds_s, acc_x, clear_accum=True)               # K dS_end
                    T.wait_wgmma(0)
                    T.barrier_arrive(ds_free)
                    for r, j in T.Parallel(C, V):
                        acc_x[r, j] = acc_x[r, j] * eu_x[r]
                    T.barrier_wait(p_ready, ph)
                    T.wgmma_gemm(p_s, do_s, acc_x, transpose_A=True)               # + P^T dO: dU
                    T.wait_wgmma(0)
                    T.barrier_arrive(do_read)
                    T.copy(acc_x, du_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(du_ready)
                    T.wgmma_gemm(tb_s, du_s, acc_x, transpose_A=True, clear_accum=True)   # dX = Tb^T dU
                    T.wait_wgmma(0)
                    for r, j in T.Parallel(C, V):
                        acc_x[r, j] = -eg_x[r] * acc_x[r, j]
                    T.barrier_wait(gx_free, ph ^ 1)
                    T.copy(acc_x, gx_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(gx_ready)
                    # the solve's backward from dU, off the chain (which the owner closes meanwhile), shared with p:
                    # x makes dTb = dU X^T -> dT = dTb diag(beta) (into P's tile, read by dU already) -> M = T^T dT
                    # (in place of dT), then dA = -M T^T (strictly lower): dA (.) D for p (the A terms, with its
                    # K K^T) and H = diag(beta) dA (.) D for g and p; p also takes dbeta's X dU^T term
                    T.clear(xf2)   # the solve's accumulators live only through it (see acc_x's below)
                    T.wgmma_gemm(du_s, x_s, xf2, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(0)
                    for r, c in T.Parallel(C, C):
                        xf2[r, c] = T.if_then_else(r < n_valid, xf2[r, c] * b_s[c], 0.0)
                    T.copy(xf2, p_s)
                    T.fence_proxy_async()
                    T.wgmma_gemm(t_s, p_s, xf2, transpose_A=True, clear_accum=True)
                    T.wait_wgmma(0)
                    T.copy(xf2, p_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(m_ready)
                    T.wgmma_gemm(p_s, t_s, xf2, transpose_B=True, clear_accum=True)     # M T^T
                    T.wait_wgmma(0)
                    # dA (.) D = -M T^T (.) D strictly below the diagonal (zeros above) into P's tile (M read), for
                    # p's row terms, and H = diag(beta) dA (.) D into h_s for g (and p's column terms). One
                    # exponential an element; the row terms' products and reductions are p's (x, whose
                    # block here ends the chunk's chain, would need its own K K^T for them)
                    for r, c in T.Parallel(C, C):
                        xf2[r, c] = masked((r > c) & (r < n_valid), -xf2[r, c], g_s, r, c)
                    T.copy(xf2, p_s)
                    for r, c in T.Parallel(C, C):
                        xf2[r, c] = b_s[r] * xf2[r, c]
                    T.barrier_wait(h_free, ph ^ 1)
                    T.copy(xf2, h_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(h_ready)
                    T.barrier_wait(du_free, ph)                # p's X dU^T has read dU's tile
                    # dv = dX made again from dU's tile, once g has H (one 64 x 128 x 64 product where keeping dX
                    # through the solve took 32 registers more than x has), and stored through that tile
                    T.clear(acc_x)   # a new live range: ptxas reads a wgmma's accumulator even where it clears it
                    T.wgmma_gemm(tb_s, du_s, acc_x, transpose_A=True, clear_accum=True)
                    T.wait_wgmma(0)
                    T.barrier_arrive(tb_free)
                    store_rows(acc_x, du_s, dv, t0, hv, n_valid)
            elif tx < 384:
                # ---- p: P, dPD, dq's dPD K; dgamma's P terms; dbeta's T term; the solve's A terms ----
                T.set_max_nreg(P_REGS, int(P_REGS > 128))   # raise, or lower, from 128
                for i in T.serial(n_chunks):
                    ph, t0, n_valid = landed(loaded, bos, eos, n_chunks, i)
                    T.barrier_wait(k_loaded, ph)
                    T.wgmma_gemm(q_s, k_s, f1, transpose_B=True, clear_accum=True)     # Q K^T
                    T.wait_wgmma(0)
                    for r, c in T.Parallel(C, C):
                        f1[r, c] = masked((r >= c) & (r < n_valid), scale * f1[r, c], g_s, r, c)
                    T.copy(f1, p_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(p_ready)
                    # dP = dO U^T; dPD = s dP (.) D; dgamma += the rows of P (.) dP minus its columns
                    T.barrier_wait(u_ready, ph)
                    T.wgmma_gemm(do_s, u_s, f2, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(0)
                    T.barrier_arrive(u_free)
                    T.barrier_arrive(do_read)                  # p's last read of dO
                    for r, c in T.Parallel(C, C):   # P (.) dP first: dPD takes dP's fragment, as x's passes do
                        f1[r, c] = f1[r, c] * f2[r, c]
                    for r, c in T.Parallel(C, C):
                        f2[r, c] = masked((r >= c) & (r < n_valid), scale * f2[r, c], g_s, r, c)
                    T.barrier_wait(pd_free, ph ^ 1)
                    T.copy(f2, pd_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(pd_ready)
                    T.reduce_sum(f1, dgp, dim=1)
                    column_sums(f1, col_p, cs_p)
                    for r in T.Parallel(C):
                        dgp[r] -= cs_p[0, r] + cs_p[1, r] + cs_p[2, r] + cs_p[3, r]
                    # its share of the solve's backward (x's comment) next, as x's dv and the next chunk's S0 and X
                    # wait for it (du_free): dbeta's term, the rows of X dU^T (.) T^T ...
                    T.barrier_wait(du_ready, ph)
                    # beta for the A terms at p's end, taken now: once p arrives at tg_read the next chunk may
                    # land and x rewrite b_s at its start (read there, after h_ready, b_s made dg, and only dg,
                    # differ from call to call where the next chunk's x got ahead of p's tail)
                    for r in T.Parallel(C):
                        bet[r] = b_s[r]
                    T.wgmma_gemm(x_s, du_s, f2, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(0)
                    T.barrier_arrive(du_free)
                    for r, c in T.Parallel(C, C):
                        f2[r, c] = T.if_then_else(c < n_valid, f2[r, c] * T.cast(t_s[c, r], accum), 0.0)
                    T.reduce_sum(f2, dbp, dim=1)
                    T.barrier_arrive(tg_read)                  # p's last reads of T and the gates
                    # ... and K K^T for the A terms at its end (below), kept through dq
                    T.wgmma_gemm(k_s, k_s, f1, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(0)
                    # dq = dPD K + g's diag(s Gamma) dO S0^T, which g left in dq's slot
                    T.clear(acc_p)   # a new live range, after dP's (see x's acc_x)
                    T.wgmma_gemm(pd_s, k_s, acc_p, clear_accum=True)
                    T.wait_wgmma(0)
                    T.barrier_arrive(pd_free)                  # p's last read of K (and its own of dPD's tile)
                    c = c0 + chunk_of(n_chunks, i)
                    T.barrier_wait(dq_part, ph)
                    add_slot(acc_p, dqk, c, hv)
                    store_slot(acc_p, dqk, c, hv, 0)
                    # once x has written dA (.) D and H, the A terms with K K^T: dbeta's the rows of dA (.) K K^T
                    # (.) D, dgamma's beta (.) those minus the columns of H (.) K K^T, taken as the rows of H^T (.)
                    # K K^T (K K^T is symmetric) from H's tile read transposed. x taking the rows (its own K K^T)
                    # and p making H^T (T M^T again, a masked pass, its own tile for g) cost more
                    T.barrier_wait(h_ready, ph)
                    T.copy(p_s, f2)
                    for r, c in T.Parallel(C, C):
                        f2[r, c] = f2[r, c] * f1[r, c]
                        f1[r, c] = f1[r, c] * T.cast(h_s[c, r], accum)
                    T.reduce_sum(f2, row_p, dim=1)
                    T.reduce_sum(f1, row_q, dim=1)
                    T.barrier_wait(h_free, ph ^ 1)             # g's tail has read the previous chunk's
                    for r in T.Parallel(C):
                        dbp_s[r] = dbp[r] + row_p[r]
                        dgp_s[r] = dgp[r] + bet[r] * row_p[r] - row_q[r]
                    T.barrier_arrive(gp_ready)
            else:
                # ---- g: dq's dO S0^T, dk; dgamma's O, X and state terms; dg ----
                T.set_max_nreg(G_REGS, int(G_REGS > 128))   # raise, or lower, from 128
                for i in T.serial(n_chunks):
                    ph, t0, n_valid = landed(loaded, bos, eos, n_chunks, i)
                    g_last = g_s[n_valid - 1]
                    for r in T.Parallel(C):
                        sg_g[r] = T.if_then_else(r < n_valid, scale * T.exp(g_s[r]), 0.0)
                        eu_g[r] = T.if_then_else(r < n_valid, T.exp(g_last - g_s[r]), 0.0)
                    # dq's first term, diag(s Gamma) dO S0^T, while dS_end and U are being made; its rows (.) Q are
                    # dgamma's O term. It leaves through dq's slot, where p adds dPD K (g making all of dq
                    # waited for p's dPD before dk could start; p making it all held the owner's do_read)
                    T.wgmma_gemm(do_s, s0_s, acc_g, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(0)
                    T.barrier_arrive(do_read)
                    for r, j in T.Parallel(C, K):
                        acc_g[r, j] = acc_g[r, j] * sg_g[r]
                    row_dot(acc_g, q_s, tmp_g, dgam)
                    c = c0 + chunk_of(n_chunks, i)
                    store_slot(acc_g, dqk, c, hv, 0)
                    T.barrier_arrive(dq_part)
                    # dk, from diag(Gamma_C / Gamma) U dS_end^T: its rows (.) K are the state decay's term
                    T.barrier_wait(u_ready, ph)
                    T.barrier_wait(ds_ready, ph)
                    T.wgmma_gemm(u_s, ds_s, acc_g, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(0)
                    T.barrier_arrive(ds_free)
                    T.barrier_arrive(u_free)
                    for r, j in T.Parallel(C, K):
                        acc_g[r, j] = acc_g[r, j] * eu_g[r]
                    T.barrier_wait(k_loaded, ph)
                    row_dot(acc_g, k_s, tmp_g, de_g)
                    # a sum over the warpgroup's rows, through shared memory behind hardware barriers 1 and 2 of
                    # 128 threads (TileLang's AllReduce), which the owner's <S0, dS_end> reduction also takes: the
                    # owner's (this chunk's) is done once tot_ready arrives, and its next one comes after this chunk's
                    # K load, which waits for g's pd_free below. Without this wait the two could meet at those
                    # barriers and each read the other's half-written workspace (dg was off by 2e-2 in 11% of its
                    # elements from call to call once g's timing moved)
                    T.barrier_wait(tot_ready, ph)
                    T.reduce_sum(de_g, carry, dim=0)
                    # - diag(Gamma) dX S0^T: its rows (.) K are X's term (the rows now hold both)
                    T.barrier_wait(gx_ready, ph)
                    T.wgmma_gemm(gx_s, s0_s, acc_g, transpose_B=True)
                    T.wait_wgmma(0)
                    T.barrier_arrive(s0_free)                  # its last read of S0: the next chunk's
                    T.barrier_arrive(gx_free)                  # and of dX's tile (the owner's came before ds_ready)
                    row_dot(acc_g, k_s, tmp_g, row_g)
                    for r in T.Parallel(C):
                        dgam[r] += row_g[r] - 2.0 * de_g[r]
                    T.barrier_wait(pd_ready, ph)
                    T.wgmma_gemm(pd_s, q_s, acc_g, transpose_A=True)                  # + dPD^T Q
                    T.wait_wgmma(0)
                    T.barrier_arrive(q_free)                   # Q's last reader: the next chunk's Q may land
                    T.barrier_wait(h_ready, ph)
                    T.wgmma_gemm(h_s, k_s, acc_g)                                       # + H K
                    T.wgmma_gemm(h_s, k_s, acc_g, transpose_A=True)                     # + H^T K
                    T.wait_wgmma(0)
                    T.barrier_arrive(pd_free)                  # K's last reader: the next chunk's K may land
                    # dk as dq (one TMA store through dX's tile, once the owner had read it, cost ~2000 clocks of
                    # g's tail from gp_ready)
                    store_slot(acc_g, dqk, c, hv, 1)
                    T.barrier_wait(gp_ready, ph)
                    for r in T.Parallel(C):
                        dg_s[r] = T.if_then_else(
                            r < n_valid,
                            dgam[r] + dgp_s[r] + T.if_then_else(r == n_valid - 1, tot_s[0] + carry[0], 0.0),
                            0.0)
                    for r in T.Parallel(C):
                        if r < n_valid:
                            dbeta[0, t0 + r, hv] = dbp_s[r]
                    T.barrier_arrive(h_free)
                    # dg: the reverse cumsum within the chunk, each row's suffix sum on its own thread (one
                    # thread's 64 dependent steps with a store each paced g's tail)
                    T.clear(sfx)
                    for j in T.serial(C):
                        for r in T.Parallel(C):
                            sfx[r] += T.if_then_else(j >= r, dg_s[j], 0.0)
                    for r in T.Parallel(C):
                        if r < n_valid:
                            dg[0, t0 + r, hv] = sfx[r]

    return gdn_backward_fused
