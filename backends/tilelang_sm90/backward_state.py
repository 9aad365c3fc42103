"""The backward's sequential pass (issue 6, docs/sm90-design.md), warp-specialized like state_output_narrow.py: per
(sequence, value head, V tile), the chunks right to left with dS [K, BV] on chip.

    producer  (threads   0-127)  TMA: Q, K, Tb, dO and gamma of chunk i (counted from the end) into stage i % STAGES
    chain     (threads 128-255)  dS_end -> bf16 dS (stored: dh, the per-chunk gradient kernel reads it)
                                 dU = P^T dO + diag(Gamma_C / Gamma) K dS      (stored)
                                 dX = Tb^T dU                                  (stored: dV)
                                 dS0 = Gamma_C dS + Q^T (s diag(Gamma) dO) - K^T (diag(Gamma) dX)
    side      (threads 256-383)  the operands of chunk i that need no dS: P = s Q K^T (.) D_incl,
                                 diag(Gamma_C / Gamma) K and s diag(Gamma) dO, handed over in bf16

The side warpgroup works on chunk i + 1 while the chain finishes chunk i, as the output warpgroup does in the
forward. Where `gate` holds 0 for its (segment, head) a CTA does nothing: the gated route launches the exact
route's pass per segment always and lets the device decide (backward._gated_ds_ends). The definition it must meet
is backends/reference/chunked_backward.py (dU, dS_end per chunk, dV).

Barriers (as in state_output_narrow.py): loaded / freed per stage (freed: chain + side, 256 arrivals), and
side_ready / side_free per hand-over slot (i % 2).

chained (context parallelism's chained route, backward.py): the programs run over segments, and each first walks
walk[n, hv] chunks after its segment, from the last back, storing nothing (another program's dS_end, dU, dX) --
as many as the decay bound needs (lead_in.walk_lengths, reverse), from a zero dS, or from the sequence's dht where
the walk reaches the sequence's end (walk == after[n]: exact; the walk then ends at seq_end[n], a tail chunk
included) -- as the forward's state pass walks back (state_output_narrow.py). dht is per segment: its sequence's.

ds_only (the gated route's passes, backward.py): nothing is stored but dh0, the dS at the run's start; du, dv
and dh are never touched (any tensors of shape (1, 1, 1, 1)). Unchained: the reverse pass over the program's
segment from zero (the exact route's F). Chained: the run is the walk alone, from the segment's end (no own
chunks): its dh0 is the segment's dS_end from a lead-in over the walked chunks after it, read in place (the
fixed lead-in's walks, or the chained route's).

Rows past a sequence's end: the side warpgroup zeroes them in all three hand-over tiles, so dU's rows there
are zero; Tb's rows there still reach dX through Tb^T dU (times zero), which is why the forward writes Tb
with zeros past cu_seqlens[-1] (an unwritten row could hold NaN).
"""
import tilelang
import tilelang.language as T

from .sequence_macros import sequence_bounds

CHUNK = 64
THREADS = 384
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
                tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}


def backward_state_program(H: int, HV: int, dtype: str = "bfloat16", has_dht: bool = False,
                           store_dh0: bool = False, block_v: int = 64, stages: int = 2, chained: bool = False,
                           ds_only: bool = False, K: int = 128, V: int = 128):
    """chained: `walk` [num_walk >= num_seqs, HV], `after` and `seq_end` [num_walk] int32 are read (module
    docstring); otherwise they are placeholders the kernel never touches. ds_only: the module docstring."""
    C = CHUNK
    BV = block_v
    NV = V // BV
    accum = "float32"
    assert HV % H == 0 and K == 128 and V == 128 and BV in (32, 64) and stages in (2, 3)
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

    @T.prim_func
    def gdn_backward_state(
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
        gate: T.Tensor((num_gates, HV), "int32"),   # 0: nothing to do (the gated route's flags, backward.py)
        walk: T.Tensor((num_walk, HV), "int32"),
        after: T.Tensor((num_walk,), "int32"),
        seq_end: T.Tensor((num_walk,), "int32"),
    ):
        with T.Kernel(NV, HV, num_seqs, threads=THREADS) as (bv, hv, n):
            hk = hv // GROUP
            v0 = bv * BV
            bos, eos_own, n_own, c0 = sequence_bounds(cu_seqlens, chunk_offsets, n)
            if chained and ds_only:   # the walk alone, from the segment's end
                bos, n_own, c0 = eos_own, 0, chunk_offsets[n + 1]
            # the run, walked from its last chunk back: the program's own n_own chunks, after `post` chunks walked
            # (chained; all whole but a sequence's tail, reached only by an exact walk), ending at token eos
            if chained:
                post = walk[n, hv]
                exact = post == after[n]   # the walk reaches the sequence's end: from dht
                eos = T.if_then_else(exact, seq_end[n], eos_own + post * C)
                n_chunks = n_own + post
            else:
                eos, n_chunks, post, exact = eos_own, n_own, 0, True

            # stage tiles (TMA destinations)
            q_s = T.alloc_shared((stages, C, K), dtype)
            k_s = T.alloc_shared((stages, C, K), dtype)
            a_s = T.alloc_shared((stages, C, C), dtype)
            do_s = T.alloc_shared((stages, C, BV), dtype)
            g_s = T.alloc_shared((stages, C), accum)
            # side -> chain hand-over
            p_s = T.alloc_shared((2, C, C), dtype)       # s Q K^T (.) D_incl (valid rows)
            ek_s = T.alloc_shared((2, C, K), dtype)      # diag(Gamma_C / Gamma) K (valid rows)
            gdo_s = T.alloc_shared((2, C, BV), dtype)    # s diag(Gamma) dO (valid rows)
            # private to the chain
            ds_s = T.alloc_shared((K, BV), dtype)        # bf16 dS_end: operand, and the source of dh's TMA store
            du_s = T.alloc_shared((C, BV), dtype)
            gdx_s = T.alloc_shared((C, BV), dtype)       # -diag(Gamma) dX, then dX for its store

            dS = T.alloc_fragment((K, BV), accum)
            acc = T.alloc_fragment((C, BV), accum)       # dU, then dX
            qk = T.alloc_fragment((C, C), accum)
            e_x = T.alloc_fragment((C,), accum)          # chain: -Gamma on the valid rows
            # side: Gamma_C / Gamma on the valid rows, in shared memory. As a (C,) fragment it made the (C, K)
            # loop below run on one 64-thread replica, around a 128-thread named barrier: a hang on the H200
            e_k = T.alloc_shared((C,), accum)
            g_last = T.alloc_var(accum)

            loaded = T.alloc_barrier(arrive_count=[128] * stages)
            freed = T.alloc_barrier(arrive_count=[256] * stages)
            side_ready = T.alloc_barrier(arrive_count=[128, 128])
            side_free = T.alloc_barrier(arrive_count=[128, 128])

            tx = T.get_thread_binding()
            # the flag of this CTA's (segment, head); one row of ones (forward.open_gate) opens every CTA
            if gate[T.min(n, num_gates - 1), hv] > 0:  # every thread reads the same flag: the CTA leaves or stays
                if tx < 128:
                    # ---- producer: chunks from the last one back ----
                    T.set_max_nreg(40, 0)
                    for i in T.serial(n_chunks):
                        s = i % stages
                        T.barrier_wait(freed[s], ((i // stages) % 2) ^ 1)
                        t0 = bos + (n_chunks - 1 - i) * C
                        T.tma_copy(q[0, t0:t0 + C, hk, 0:K], q_s[s, :, :], barrier=loaded[s])
                        T.tma_copy(k[0, t0:t0 + C, hk, 0:K], k_s[s, :, :], barrier=loaded[s])
                        T.tma_copy(a[0, t0:t0 + C, hv, 0:C], a_s[s, :, :], barrier=loaded[s])
                        T.tma_copy(do[0, t0:t0 + C, hv, v0:v0 + BV], do_s[s, :, :], barrier=loaded[s])
                        T.tma_copy(gamma[hv, c0 + n_chunks - 1 - i, 0:C], g_s[s, :], barrier=loaded[s])
                        T.barrier_arrive(loaded[s])
                elif tx < 256:
                    # ---- chain ----
                    T.set_max_nreg(232, 1)
                    if has_dht and exact:  # exact: a chained walk reaching the sequence's boundary, else always
                        T.copy(dht[n, hv, 0:K, v0:v0 + BV], dS)
                    else:
                        T.clear(dS)
                    for i in T.serial(n_chunks):
                        s = i % stages
                        h = i % 2
                        ci = n_chunks - 1 - i
                        t0 = bos + ci * C
                        n_valid = T.min(eos - t0, C)
                        T.barrier_wait(loaded[s], (i // stages) % 2)
                        T.barrier_wait(side_ready[h], (i // 2) % 2)
                        T.copy(dS, ds_s)
                        T.fence_proxy_async()
                        if not ds_only and i >= post:  # own chunks: the walk's are another program's to store
                            T.copy(ds_s, dh[c0 + ci, hv, 0:K, v0:v0 + BV])                          # dS_end of the chunk
                        T.wgmma_gemm(p_s[h, :, :], do_s[s, :, :], acc, transpose_A=True, clear_accum=True)   # P^T dO
                        T.wgmma_gemm(ek_s[h, :, :], ds_s, acc)                                   # + diag(e) K dS
                        T.wait_wgmma(0)
                        T.copy(acc, du_s)
                        T.fence_proxy_async()
                        if not ds_only and i >= post:
                            if n_valid == C:
                                T.copy(du_s, du[0, t0:t0 + C, hv, v0:v0 + BV])
                            else:
                                for r, j in T.Parallel(C, BV):
                                    if r < n_valid:
                                        du[0, t0 + r, hv, v0 + j] = du_s[r, j]
                        T.wgmma_gemm(a_s[s, :, :], du_s, acc, transpose_A=True, clear_accum=True)   # dX = Tb^T dU
                        g_last = g_s[s, n_valid - 1]
                        for r in T.Parallel(C):
                            e_x[r] = T.if_then_else(r < n_valid, -T.exp(g_s[s, r]), 0.0)
                        T.wait_wgmma(0)
                        for r, j in T.Parallel(C, BV):
                            gdx_s[r, j] = acc[r, j] * e_x[r]
                        T.fence_proxy_async()
                        for r, j in T.Parallel(K, BV):
                            dS[r, j] = dS[r, j] * T.exp(g_last)
                        T.wgmma_gemm(q_s[s, :, :], gdo_s[h, :, :], dS, transpose_A=True)        # + Q^T s Gamma dO
                        T.wgmma_gemm(k_s[s, :, :], gdx_s, dS, transpose_A=True)                  # - K^T Gamma dX
                        T.wait_wgmma(0)
                        T.barrier_arrive(side_free[h])
                        T.barrier_arrive(freed[s])
                        if not ds_only and i >= post:
                            for r, j in T.Parallel(C, BV):
                                if r < n_valid:
                                    dv[0, t0 + r, hv, v0 + j] = acc[r, j]
                    if store_dh0:
                        T.copy(dS, dh0[n, hv, 0:K, v0:v0 + BV])
                else:
                    # ---- side: the chunk's operands that need no dS ----
                    T.set_max_nreg(232, 1)
                    for i in T.serial(n_chunks):
                        s = i % stages
                        h = i % 2
                        t0 = bos + (n_chunks - 1 - i) * C
                        n_valid = T.min(eos - t0, C)
                        T.barrier_wait(loaded[s], (i // stages) % 2)
                        T.barrier_wait(side_free[h], ((i // 2) % 2) ^ 1)
                        T.wgmma_gemm(q_s[s, :, :], k_s[s, :, :], qk, transpose_B=True, clear_accum=True)  # Q K^T
                        g_last = g_s[s, n_valid - 1]
                        for r in T.Parallel(C):
                            e_k[r] = T.if_then_else(r < n_valid, T.exp(g_last - g_s[s, r]), 0.0)
                        for r, j in T.Parallel(C, K):
                            ek_s[h, r, j] = k_s[s, r, j] * e_k[r]
                        for r, j in T.Parallel(C, BV):
                            gdo_s[h, r, j] = T.if_then_else(r < n_valid, do_s[s, r, j] * (scale * T.exp(g_s[s, r])), 0.0)
                        T.wait_wgmma(0)
                        for r, c in T.Parallel(C, C):
                            qk[r, c] = T.if_then_else(r >= c, T.if_then_else(r < n_valid, qk[r, c] * (scale * T.exp(g_s[s, r] - g_s[s, c])), 0.0), 0.0)
                        T.copy(qk, p_s[h, :, :])
                        T.fence_proxy_async()
                        T.barrier_arrive(side_ready[h])
                        T.barrier_arrive(freed[s])

    return gdn_backward_state
