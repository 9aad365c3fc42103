"""The backward's reverse pass at the full V = 128 columns (docs/sm90-design.md): per (sequence or segment,
value head), the chunks right to left with dS [K, V] fp32 in one warpgroup's registers; the same
outputs as backward_state.py (dh, dU, dV, dh0), one program per head instead of one per V tile.

Per chunk, with A = s P^T dO (P = Q K^T (.) D_incl), W = (Tb diag(Gamma)) K and K^T diag(Gamma) dX = W^T dU:

    dU  = A + diag(Gamma_C / Gamma) (K dS_end)
    dS0 = Gamma_C dS_end + Q^T (s diag(Gamma) dO) - W^T dU
    dX  = Tb^T dU                                                      (dV; off the chain)

    owner  (threads   0-127)  dS in registers: hands bf16 dS_end over, dS <- Gamma_C dS, scales dO's stage tile in
                              place to s diag(Gamma) dO once x has read it, dS += Q^T (that) before dU exists,
                              then dS += (-W)^T dU
    x      (threads 128-255)  A first (Q K^T, the mask, P through a private tile), then K dS_end as soon as it
                              arrives; dU = A + diag(Gamma_C / Gamma) (K dS_end) handed over
    side   (threads 256-383)  -W of each chunk (needed only by the owner's last product of the chunk, so it is made
                              while the chunk's dS_end, K dS_end and dU are on the chain); the dh store; dX = Tb^T dU
                              and the dU and dV stores; the TMA loads of chunk i + STAGES once the three roles are
                              done with chunk i

x paces the pass: between handing dU over and the next K dS_end it makes the next chunk's A. dX and the three
stores were x's in the first form, whose clock64 timeline of a step (H200, 16/32 1x32768) read ~8850
clocks: x's A ~3600, K dS_end with the dh store ~2140, dU ~520, dX ~440, the dU / dV stores ~1870, while the
side waited ~6800 of them.

So the chain per chunk is dS_end's copy -> K dS_end -> dU -> W^T dU: two 128-deep products, where
backward_state.py has three at half the width. Nothing is handed over that its consumer could make itself, so
one slot of each tile suffices.

Shared memory (bytes): 2 stages x (Q 16K + K 16K + Tb 8K + dO 16K + gamma 256) = 115200; bf16 dS_end 32768; dU
16384; P 8192 (x); Tb Gamma 8192, -W 16384 and dV's staging 16384 (side); three vectors of 64: 213760.

Barriers (stage s = i % STAGES; one-slot tiles have parity i % 2, flipped for "free"):
    loaded[s]   side's TMA -> all          freed[s]   all three -> the side's next load (384)
    ds_ready    owner -> x, side           ds_free    x (K dS_end has read it) and side (the dh store) -> owner
    do_read     x (A has read dO) -> owner (which then scales dO in place)
    du_ready    x -> owner, side           du_free    owner (W^T dU) and side (dX, the dU store) -> x
    w_ready     side -> owner              w_free     owner -> side

chained: as backward_state.py's chained build, the run is the program's own chunks followed by `post` walked
chunks after them (walk[n, hv]), taken from the last back: from the sequence's dht where the walk reaches its
end (walk == after[n]), else from zero; the walk's chunks store nothing. `gate` and ds_only as backward_state.py's
(ds_only: no dX either, which only dV needs).
"""
import tilelang
import tilelang.language as T

from .sequence_macros import sequence_bounds

CHUNK = 64
THREADS = 384
STAGES = 2
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
                tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}


def backward_state_wide_program(H: int, HV: int, dtype: str = "bfloat16", has_dht: bool = False,
                                store_dh0: bool = False, chained: bool = False, ds_only: bool = False,
                                K: int = 128, V: int = 128):
    """The TileLang prim_func, with backward_state.py's arguments (block_v is all of V)."""
    C = CHUNK
    accum = "float32"
    assert HV % H == 0 and K == 128 and V == 128
    GROUP = HV // H

    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_seqs = T.dynamic("num_seqs")
    num_dht = T.dynamic("num_dht")
    num_dh0 = T.dynamic("num_dh0")
    num_gates = T.dynamic("num_gates")
    num_walk = T.dynamic("num_walk")
    GRAD_SHAPE = (1, 1, 1, 1) if ds_only else (1, num_tokens, HV, V)
    DH_SHAPE = (1, 1, 1, 1) if ds_only else (num_chunks, HV, K, V)

    @T.macro
    def load(q, k, a, do, gamma, q_s, k_s, a_s, do_s, g_s, loaded, bos, c0, n_chunks, hk, hv, i, s):
        """TMA of the run's chunk i counted from the end into stage s (the side's 128 threads arrive)."""
        ci = n_chunks - 1 - i
        t0 = bos + ci * C
        T.tma_copy(q[0, t0:t0 + C, hk, 0:K], q_s[s, :, :], barrier=loaded[s])
        T.tma_copy(k[0, t0:t0 + C, hk, 0:K], k_s[s, :, :], barrier=loaded[s])
        T.tma_copy(a[0, t0:t0 + C, hv, 0:C], a_s[s, :, :], barrier=loaded[s])
        T.tma_copy(do[0, t0:t0 + C, hv, 0:V], do_s[s, :, :], barrier=loaded[s])
        T.tma_copy(gamma[hv, c0 + ci, 0:C], g_s[s, :], barrier=loaded[s])
        T.barrier_arrive(loaded[s])

    @T.macro
    def landed(loaded, bos, eos, n_chunks, i):
        """Chunk i of the run, counted from its end, once its stage's tiles have landed: (stage, the chunk's
        index in the run, its first token, its rows inside the sequence). Every role starts its step here."""
        s = i % STAGES
        ci = n_chunks - 1 - i
        t0 = bos + ci * C
        T.barrier_wait(loaded[s], (i // STAGES) % 2)
        return s, ci, t0, T.min(eos - t0, C)

    @T.prim_func
    def gdn_backward_state_wide(
        q: T.Tensor((1, num_tokens, H, K), dtype),
        k: T.Tensor((1, num_tokens, H, K), dtype),
        a: T.Tensor((1, num_tokens, HV, C), dtype),
        do: T.Tensor((1, num_tokens, HV, V), dtype),
        gamma: T.Tensor((HV, num_chunks, C), accum),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        chunk_offsets: T.Tensor((num_seqs + 1,), "int32"),
        dht: T.Tensor((num_dht, HV, K, V), accum),
        du: T.Tensor(GRAD_SHAPE, dtype),
        dv: T.Tensor(GRAD_SHAPE, dtype),
        dh: T.Tensor(DH_SHAPE, dtype),
        dh0: T.Tensor((num_dh0, HV, K, V), accum),
        scale: T.float32,
        gate: T.Tensor((num_gates, HV), "int32"),
        walk: T.Tensor((num_walk, HV), "int32"),
        after: T.Tensor((num_walk,), "int32"),
        seq_end: T.Tensor((num_walk,), "int32"),
    ):
        with T.Kernel(HV, num_seqs, threads=THREADS) as (hv, n):
            hk = hv // GROUP
            bos, eos_own, n_own, c0 = sequence_bounds(cu_seqlens, chunk_offsets, n)
            if chained and ds_only:   # the walk alone, from the segment's end
                bos, n_own, c0 = eos_own, 0, chunk_offsets[n + 1]
            if chained:
                post = walk[n, hv]
                exact = post == after[n]   # the walk reaches the sequence's end: from dht
                eos = T.if_then_else(exact, seq_end[n], eos_own + post * C)
                n_chunks = n_own + post
            else:
                eos, n_chunks, post, exact = eos_own, n_own, 0, True

            q_s = T.alloc_shared((STAGES, C, K), dtype)
            k_s = T.alloc_shared((STAGES, C, K), dtype)
            a_s = T.alloc_shared((STAGES, C, C), dtype)
            do_s = T.alloc_shared((STAGES, C, V), dtype)      # dO, then (owner, in place) s diag(Gamma) dO
            g_s = T.alloc_shared((STAGES, C), accum)
            ds_s = T.alloc_shared((K, V), dtype)              # bf16 dS_end: x's K dS_end, the source of dh's store
            du_s = T.alloc_shared((C, V), dtype)              # dU: the owner's W^T dU, x's Tb^T dU, du's store
            dv_s = T.alloc_shared((C, V), dtype)              # side: dV's staging for its TMA store
            p_s = T.alloc_shared((C, C), dtype)               # x: s P (valid rows)
            tg_s = T.alloc_shared((C, C), dtype)              # side: Tb diag(Gamma)
            w_s = T.alloc_shared((C, K), dtype)               # side -> owner: -W
            # per-row factors in shared memory (a (C,) fragment under a (C, K) loop ran on a 64-thread replica
            # around a 128-thread barrier in backward_state.py: a hang on the H200)
            sg_s = T.alloc_shared((C,), accum)                # owner: s Gamma (0 past the chunk's rows)
            eu_s = T.alloc_shared((C,), accum)                # x: Gamma_C / Gamma (0 past them)
            eg_s = T.alloc_shared((C,), accum)                # side: Gamma (0 past them)

            dS = T.alloc_fragment((K, V), accum)              # owner
            acc_a = T.alloc_fragment((C, V), accum)           # x: A, then dU
            acc_k = T.alloc_fragment((C, V), accum)           # x: K dS_end
            qk = T.alloc_fragment((C, C), accum)              # x
            acc_w = T.alloc_fragment((C, K), accum)           # side: W, then dX
            g_last = T.alloc_var(accum)

            loaded = T.alloc_barrier(arrive_count=[128] * STAGES)
            freed = T.alloc_barrier(arrive_count=[384] * STAGES)
            ds_ready = T.alloc_barrier(arrive_count=128)
            ds_free = T.alloc_barrier(arrive_count=256)
            do_read = T.alloc_barrier(arrive_count=128)
            du_ready = T.alloc_barrier(arrive_count=128)
            du_free = T.alloc_barrier(arrive_count=256)
            w_ready = T.alloc_barrier(arrive_count=128)
            w_free = T.alloc_barrier(arrive_count=128)

            tx = T.get_thread_binding()
            if gate[T.min(n, num_gates - 1), hv] > 0:  # every thread reads the same flag: the CTA leaves or stays
                if tx < 128:
                    # ---- owner: dS in registers ----
                    if has_dht and exact:
                        T.copy(dht[n, hv, 0:K, 0:V], dS)
                    else:
                        T.clear(dS)
                    for i in T.serial(n_chunks):
                        s, _, t0, n_valid = landed(loaded, bos, eos, n_chunks, i)
                        T.barrier_wait(ds_free, (i % 2) ^ 1)       # x has read the previous dS_end
                        T.copy(dS, ds_s)
                        T.fence_proxy_async()
                        T.barrier_arrive(ds_ready)
                        g_last = g_s[s, n_valid - 1]
                        for r in T.Parallel(C):
                            sg_s[r] = T.if_then_else(r < n_valid, scale * T.exp(g_s[s, r]), 0.0)
                        for r, j in T.Parallel(K, V):
                            dS[r, j] = dS[r, j] * T.exp(g_last)
                        T.barrier_wait(do_read, i % 2)             # x's A has read dO: scale it in place
                        for r, j in T.Parallel(C, V):
                            do_s[s, r, j] = do_s[s, r, j] * sg_s[r]
                        T.fence_proxy_async()
                        T.wgmma_gemm(q_s[s, :, :], do_s[s, :, :], dS, transpose_A=True)        # + Q^T s Gamma dO
                        T.barrier_wait(w_ready, i % 2)
                        T.barrier_wait(du_ready, i % 2)
                        T.wait_wgmma(0)                # Q^T dO has read the stage: the next load may take it
                        T.barrier_arrive(freed[s])
                        T.wgmma_gemm(w_s, du_s, dS, transpose_A=True)                        # - W^T dU
                        T.wait_wgmma(0)
                        T.barrier_arrive(du_free)
                        T.barrier_arrive(w_free)
                    if store_dh0:
                        T.copy(dS, dh0[n, hv, 0:K, 0:V])
                elif tx < 256:
                    # ---- x: A, K dS_end, dU ----
                    for i in T.serial(n_chunks):
                        s, ci, t0, n_valid = landed(loaded, bos, eos, n_chunks, i)
                        T.wgmma_gemm(q_s[s, :, :], k_s[s, :, :], qk, transpose_B=True, clear_accum=True)  # Q K^T
                        g_last = g_s[s, n_valid - 1]
                        for r in T.Parallel(C):
                            eu_s[r] = T.if_then_else(r < n_valid, T.exp(g_last - g_s[s, r]), 0.0)
                        T.wait_wgmma(0)
                        for r, c in T.Parallel(C, C):
                            p_s[r, c] = T.if_then_else(r >= c, T.if_then_else(r < n_valid, qk[r, c] * (scale * T.exp(g_s[s, r] - g_s[s, c])), 0.0), 0.0)
                        T.fence_proxy_async()
                        T.wgmma_gemm(p_s, do_s[s, :, :], acc_a, transpose_A=True, clear_accum=True)   # A = s P^T dO
                        T.wait_wgmma(0)
                        T.barrier_arrive(do_read)
                        T.barrier_wait(ds_ready, i % 2)
                        T.wgmma_gemm(k_s[s, :, :], ds_s, acc_k, clear_accum=True)                   # K dS_end
                        T.wait_wgmma(0)
                        T.barrier_arrive(ds_free)
                        for r, j in T.Parallel(C, V):
                            acc_a[r, j] = acc_a[r, j] + acc_k[r, j] * eu_s[r]
                        T.barrier_wait(du_free, (i % 2) ^ 1)           # the owner and the side have read the last one
                        T.copy(acc_a, du_s)
                        T.fence_proxy_async()
                        T.barrier_arrive(du_ready)
                        T.barrier_arrive(freed[s])
                else:
                    # ---- side: -W, the dh store, dX and the dU / dV stores, the loads ----
                    for i in T.serial(T.min(n_chunks, STAGES)):
                        load(q, k, a, do, gamma, q_s, k_s, a_s, do_s, g_s, loaded, bos, c0, n_chunks, hk, hv,
                             i, i)
                    for i in T.serial(n_chunks):
                        s, ci, t0, n_valid = landed(loaded, bos, eos, n_chunks, i)
                        for r in T.Parallel(C):
                            eg_s[r] = T.if_then_else(r < n_valid, T.exp(g_s[s, r]), 0.0)
                        for r, c in T.Parallel(C, C):
                            tg_s[r, c] = a_s[s, r, c] * eg_s[c]
                        T.fence_proxy_async()
                        T.wgmma_gemm(tg_s, k_s[s, :, :], acc_w, clear_accum=True)            # W = Tb Gamma K
                        T.wait_wgmma(0)
                        T.barrier_wait(w_free, (i % 2) ^ 1)          # the owner's last product has read -W
                        for r, j in T.Parallel(C, K):
                            w_s[r, j] = -acc_w[r, j]
                        T.fence_proxy_async()
                        T.barrier_arrive(w_ready)
                        # dh: dS_end's TMA store from the owner's hand-over tile
                        T.barrier_wait(ds_ready, i % 2)
                        if not ds_only and i >= post:  # own chunks: the walk's are another program's to store
                            T.copy(ds_s, dh[c0 + ci, hv, 0:K, 0:V])
                        T.barrier_arrive(ds_free)
                        # dX = Tb^T dU (dV) into -W's accumulator, dead since its store; Tb is the last stage tile
                        # the side reads, so the stage is released and the next load issued before the dU and dV
                        # stores
                        T.barrier_wait(du_ready, i % 2)
                        if not ds_only:
                            T.wgmma_gemm(a_s[s, :, :], du_s, acc_w, transpose_A=True, clear_accum=True)
                            T.wait_wgmma(0)
                        T.barrier_arrive(freed[s])
                        T.barrier_wait(freed[s], (i // STAGES) % 2)
                        if i + STAGES < n_chunks:
                            load(q, k, a, do, gamma, q_s, k_s, a_s, do_s, g_s, loaded, bos, c0, n_chunks,
                                 hk, hv, i + STAGES, s)
                        if not ds_only and i >= post:
                            if n_valid == C:
                                T.copy(du_s, du[0, t0:t0 + C, hv, 0:V])
                                T.copy(acc_w, dv_s)
                                T.fence_proxy_async()
                                T.copy(dv_s, dv[0, t0:t0 + C, hv, 0:V])
                            else:
                                for r, j in T.Parallel(C, V):
                                    if r < n_valid:
                                        du[0, t0 + r, hv, j] = du_s[r, j]
                                        dv[0, t0 + r, hv, j] = acc_w[r, j]
                        T.barrier_arrive(du_free)

    return gdn_backward_state_wide
