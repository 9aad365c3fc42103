"""The gated delta rule token by token in Triton: triton_generic's decode, multi-token verify and serving state pool
(fused_recurrent.py), and the causal repair both chunked GPU backends run after their forward.

One program per (sequence, value head, V tile) keeps its K x BV slice of the state in registers in fp32
and walks that sequence's tokens, so the state crosses HBM once in and once out (plus one write per
kept intermediate state). At one token per sequence the kernel is a copy of the state with a few hundred
FLOPs on the side: the launch settings below are chosen for wide, coalesced state loads and stores.

Where states come from and go to (decided by the validated Problem; see gdnkit/problem.py):
  - plain call: initial_state [N, ...] row n in, a new fp32 final state [N, ...] out;
  - serving (`ssm_state_indices`): initial_state is a pool [num_slots, ...] (fp32/bf16/fp16, any slot
    stride, inner dims contiguous). 1-D indices [N]: sequence n reads and (inplace) writes slot idx[n].
    2-D indices [N, C]: sequence n reads slot idx[n, num_accepted_tokens[n] - 1] (idx[n, 0] without
    it) and writes the state after its token t to slot idx[n, t]. With parent_indices [N, C] (tree
    verify) token t continues from the state of token parent[n, t], read back from its slot, when that is
    not t - 1 (from the starting state, kept in registers, for -1). A read slot of -1 marks a padding
    sequence: no state memory is touched and its outputs are 0; a write slot of -1 skips that write.
No host sync and no allocation besides o (and the final state when one is returned): CUDA-graph
capturable.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from gdnkit.problem import GDNInputs, Problem

from .launch import enqueue
from .sizes import cdiv, flat_grid, next_power_of_2

# State read: none (zeros), row n of a dense [N, ...] tensor, or a pool slot looked up in the indices.
READ_NONE, READ_DENSE, READ_SLOT = 0, 1, 2
# State write: none, dense final [N, ...], pool slot of the sequence (final), pool slot per token.
WRITE_NONE, WRITE_DENSE, WRITE_SLOT_FINAL, WRITE_SLOT_PER_TOKEN = 0, 1, 2, 3


@triton.jit
def _softplus(x):
    # torch's threshold: beyond 20, softplus(x) == x in fp32
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def recurrent_kernel(
    q, k, v, g, beta, A_log, dt_bias, o, h0, ht, cu_seqlens, slots, num_accepted, parents,
    scale, T, T_total, N, stride_h0_slot, stride_ht_slot, stride_slots_seq, SLOT_COLS,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, READ: tl.constexpr, WRITE: tl.constexpr, HAS_ACCEPTED: tl.constexpr,
    QK_L2NORM: tl.constexpr, GATE_IN_KERNEL: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, V_FIRST: tl.constexpr, TREE: tl.constexpr,
    REPAIR: tl.constexpr = False, CHUNK: tl.constexpr = 64, SCAN: tl.constexpr = 64,
):
    NV = tl.cdiv(V, BV)
    pid = tl.program_id(0).to(tl.int64)
    # V tiles of one (sequence, head) are adjacent programs: they share q/k in L2
    i_v = pid % NV
    i_nh = pid // NV
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)

    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n * T
        eos = bos + T
    seq_len = eos - bos

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    if V_FIRST:
        offs_h = o_v[:, None] * K + o_k[None, :]
        mask_h = mask_v[:, None] & mask_k[None, :]
    else:
        offs_h = o_k[:, None] * V + o_v[None, :]
        mask_h = mask_k[:, None] & mask_v[None, :]
    state_base = i_hv * (K * V)

    # REPAIR (repair_nonfinite_chunks): o holds the chunked form's output. This program reads its V tile of o at
    # the last token of each of the sequence's chunks, SCAN chunks a load: the first chunk whose row is not finite
    # is where a non-finite input entered (a chunk's products carry it to every row of its chunk, the earlier ones
    # included, as 0 * NaN; every later chunk inherits it through the state). The recurrence then walks the
    # sequence from its starting state and rewrites the outputs from that chunk on; where no row is bad it walks
    # no token and reads no state.
    walk = seq_len
    write_from = seq_len * 0
    if REPAIR:
        n_chunks = tl.cdiv(seq_len, CHUNK)
        first_bad = n_chunks
        for c0 in range(0, n_chunks, SCAN):
            rows = c0 + tl.arange(0, SCAN)
            last = bos + tl.minimum((rows + 1) * CHUNK, seq_len) - 1
            x = tl.load(o + (last[:, None] * HV + i_hv) * V + o_v[None, :],
                        mask=(rows < n_chunks)[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
            # NaN, or +-inf (beyond fp32's largest finite value)
            bad = tl.max(((x != x) | (tl.abs(x) > 3.4028234663852886e38)).to(tl.int32), axis=1)
            first_bad = tl.minimum(first_bad, tl.min(tl.where(bad > 0, rows, n_chunks), axis=0))
        walk = tl.where(first_bad < n_chunks, seq_len, 0)
        write_from = first_bad * CHUNK

    # A padding sequence (read slot -1) touches no state memory. The flag is kept as full tiles because
    # the interpreter rejects a scalar bool broadcast into a load mask.
    read_slot = i_n * 0
    if READ == 2:
        col = 0
        if HAS_ACCEPTED:
            col = tl.load(num_accepted + i_n).to(tl.int64) - 1
            col = tl.minimum(tl.maximum(col, 0), SLOT_COLS - 1)
        read_slot = tl.load(slots + i_n * stride_slots_seq + col).to(tl.int64)
    live_h = mask_h & ((offs_h * 0 + read_slot) >= 0)
    live_v = (o_v * 0 + read_slot) >= 0
    if READ == 2:
        p_h0 = h0 + tl.maximum(read_slot, 0) * stride_h0_slot + state_base + offs_h
        b_h = tl.load(p_h0, mask=live_h, other=0.0, eviction_policy="evict_first").to(tl.float32)
    elif READ == 1:
        p_h0 = h0 + i_nh * (K * V) + offs_h
        read_h = mask_h
        if REPAIR:
            read_h = read_h & ((offs_h * 0 + walk) > 0)
        b_h = tl.load(p_h0, mask=read_h, other=0.0, eviction_policy="evict_first").to(tl.float32)
    else:
        if V_FIRST:
            b_h = tl.zeros([BV, BK], dtype=tl.float32)
        else:
            b_h = tl.zeros([BK, BV], dtype=tl.float32)

    if GATE_IN_KERNEL:
        b_A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        if HAS_DT_BIAS:
            b_bias = tl.load(dt_bias + i_hv).to(tl.float32)

    if TREE:
        b_h_start = b_h  # a token with parent -1 restarts here: its slot may be overwritten by then

    p_q = q + (bos * H + i_h) * K + o_k
    p_k = k + (bos * H + i_h) * K + o_k
    p_v = v + (bos * HV + i_hv) * V + o_v
    p_g = g + bos * HV + i_hv
    p_beta = beta + bos * HV + i_hv
    p_o = o + (bos * HV + i_hv) * V + o_v
    for i_t in range(0, walk):
        if TREE:
            # a parent other than the previous token: its state, written to its slot by this program at that
            # token (the barrier orders those stores before these loads across the program's threads)
            # (a padding sequence may be longer than the index tensor: past it, the chain)
            par = tl.load(parents + i_n * stride_slots_seq + i_t, mask=i_t < SLOT_COLS, other=i_t - 1).to(tl.int64)
            jump = (offs_h * 0 + par) != i_t - 1
            from_slot = jump & ((offs_h * 0 + par) >= 0)
            par_slot = tl.load(slots + i_n * stride_slots_seq + tl.maximum(par, 0),
                               mask=(par >= 0) & (par < SLOT_COLS), other=-1).to(tl.int64)
            tl.debug_barrier()
            b_par = tl.load(ht + tl.maximum(par_slot, 0) * stride_ht_slot + state_base + offs_h,
                            mask=live_h & from_slot, other=0.0).to(tl.float32)
            b_h = tl.where(from_slot, b_par, tl.where(jump, b_h_start, b_h))
        b_q = tl.load(p_q, mask=mask_k, other=0.0).to(tl.float32)
        b_k = tl.load(p_k, mask=mask_k, other=0.0).to(tl.float32)
        b_v = tl.load(p_v, mask=mask_v, other=0.0).to(tl.float32)
        b_g = tl.load(p_g).to(tl.float32)
        b_beta = tl.load(p_beta).to(tl.float32)
        if QK_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_q = b_q * scale
        if GATE_IN_KERNEL:
            if HAS_DT_BIAS:
                b_g = b_g + b_bias
            b_g = -b_A * _softplus(b_g)
        if BETA_SIGMOID:
            b_beta = tl.sigmoid(b_beta)
            if NEG_EIGVAL:
                b_beta = b_beta * 2.0

        b_h = b_h * tl.exp(b_g)
        if V_FIRST:
            b_u = b_beta * (b_v - tl.sum(b_h * b_k[None, :], 1))
            b_h = b_h + b_u[:, None] * b_k[None, :]
            b_o = tl.sum(b_h * b_q[None, :], 1)
        else:
            b_u = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
            b_h = b_h + b_k[:, None] * b_u[None, :]
            b_o = tl.sum(b_h * b_q[:, None], 0)
        b_o = tl.where(live_v, b_o, 0.0)
        if REPAIR:
            tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_v & ((o_v * 0 + i_t) >= write_from))
        else:
            tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_v)

        if WRITE == 3:
            # intermediate states for rollback; a column past the index tensor is never written
            slot_t = tl.load(slots + i_n * stride_slots_seq + i_t, mask=i_t < SLOT_COLS, other=-1).to(tl.int64)
            p_ht = ht + tl.maximum(slot_t, 0) * stride_ht_slot + state_base + offs_h
            tl.store(p_ht, b_h.to(p_ht.dtype.element_ty), mask=live_h & ((offs_h * 0 + slot_t) >= 0),
                     eviction_policy="evict_first")

        p_q += H * K
        p_k += H * K
        p_v += HV * V
        p_g += HV
        p_beta += HV
        p_o += HV * V

    if WRITE == 2:
        p_ht = ht + tl.maximum(read_slot, 0) * stride_ht_slot + state_base + offs_h
        tl.store(p_ht, b_h.to(p_ht.dtype.element_ty), mask=live_h, eviction_policy="evict_first")
    elif WRITE == 1:
        # a padding sequence gets a zero row, so the returned tensor holds no garbage
        p_ht = ht + i_nh * (K * V) + offs_h
        b_h = tl.where(live_h, b_h, 0.0)
        tl.store(p_ht, b_h.to(p_ht.dtype.element_ty), mask=mask_h, eviction_policy="evict_first")

    if IS_VARLEN:
        if not REPAIR:   # (the chunked forward has zeroed them)
            # tokens past cu_seqlens[-1] belong to no sequence: the last sequence's programs zero them here
            # rather than a separate memset (one launch fewer per decode step)
            tail_end = tl.where(i_n == N - 1, T_total, eos)
            p_tail = o + (eos * HV + i_hv) * V + o_v
            for _ in range(eos, tail_end):
                tl.store(p_tail, tl.zeros([BV], dtype=tl.float32).to(p_tail.dtype.element_ty), mask=mask_v)
                p_tail += HV * V


def launch_config(K: int, V: int, n_heads_total: int, state_bytes: int = 4, v_first: bool = False,
                  per_token_states: bool = False) -> tuple[int, int]:
    """(BV, num_warps) for a K x V state of state_bytes an element (4: fp32, 2: bf16/fp16), stored [K, V] or
    (v_first) [V, K], and N*HV (sequence, head) pairs; per_token_states: every token's state is written (a
    verify), not only the last.

    Measured on the H200 (benchmarks/results/h200/results.md, decode; K = V = 128): a 128 x 64 fp32 tile over 4
    warps (64 state registers a thread, 16-byte row loads) moved the state at 3.77-3.93 TB/s where
    128 x 32 reached 3.65-3.75; 1 warp per 128 x 16 tile was fastest at B=1 (4.2 us), where only the
    spread over SMs matters. Small batches go narrower until ~512 programs cover the 132 SMs.
    A 16-bit state stored [K, V] takes 2 warps a 128 x 64 tile: on the H100 (benchmarks/results/h100/
    decode-tiles.md) 4 warps were 3-5% slower at 16/64 B=64, 16/32 B=256 and 2/8 B=256, where [V, K] and fp32
    tiles ran within 1% either way.
    A verify (T = 4 draft tokens, each token's state stored) walks T dependent steps a program, each ending in a
    state store: narrower tiles, more programs in flight, hide that chain. H100 sweep (benchmarks/results/h100/
    decode-tiles.md, verify), against the 128 x 64 / 4 warps decode tile: [V, K] states at 16 x 128, 1 warp,
    were fastest for bf16 and fp32 at every point (bf16 16/32 B=256 589 -> 494 us, 16/64 B=64 256 -> 244, 2/8
    B=256 126 -> 121; fp32 16/32 B=256 1014 -> 948); [K, V] bf16 states at 128 x 32, 2 warps (667 -> 585 at
    16/32 B=256: a 16-column row is 32 bytes, too short a store); [K, V] fp32 kept the decode tile.
    """
    BK = next_power_of_2(K)
    verify_tile = per_token_states and (v_first or state_bytes == 2)
    BV = (16 if v_first else 32) if verify_tile else max(8, min(next_power_of_2(V), 8192 // BK))
    while BV > 8 and n_heads_total * cdiv(V, BV) < 512:
        BV //= 2
    if verify_tile:
        return BV, 1 if v_first else 2
    num_warps = 4 if BK * BV >= 8192 else (2 if BK * BV >= 4096 else 1)
    if state_bytes == 2 and not v_first and num_warps == 4:
        num_warps = 2
    return BV, num_warps


def option_flags(problem: Problem) -> dict:
    """recurrent_kernel's constexpr flags for the call's options, as every launch of it passes them."""
    return dict(QK_L2NORM=problem.use_qk_l2norm_in_kernel, GATE_IN_KERNEL=problem.use_gate_in_kernel,
                HAS_DT_BIAS=problem.has_dt_bias, BETA_SIGMOID=problem.use_beta_sigmoid_in_kernel,
                NEG_EIGVAL=problem.allow_neg_eigval, V_FIRST=problem.state_v_first)


def _compiles_here(o: torch.Tensor) -> bool:
    """Whether a launch on o's device compiles a kernel (a GPU, not the Triton interpreter)."""
    return o.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"


def repair_nonfinite_chunks(problem: Problem, inputs: GDNInputs, o: torch.Tensor, compile_only: bool = False) -> None:
    """Make a chunked forward's output causal where a non-finite input reached it (docs/semantics.md), in place.

    The chunked kernels mix a chunk's 64 rows in products where a masked-out pair still multiplies (0 * NaN =
    NaN), so a NaN or Inf in k, v, g or beta at token t reaches the outputs of t's chunk before t. One launch of
    the recurrent kernel in REPAIR mode finds, per (sequence, value head, V tile), the first chunk whose last row
    is not finite and redoes that sequence's outputs from there token by token, from its starting state, with
    the call's options. With finite inputs it reads o's last row of every chunk (1/64 of o) and walks nothing.
    A call with a bad input pays a token-by-token pass over the affected sequences.

    Not for a pool prefill (problem.serving): its starting states are pool slots the forward has already
    overwritten with the final states, so its outputs keep the chunk-level bound the docs state.

    compile_only: build the launch's kernel and run nothing (Triton's warmup), for a first call's dry run
    (tilelang_sm90's kernel_build), where o holds no output yet: the compile then runs beside the TileLang builds
    instead of after them. Nothing to do off a GPU or under the Triton interpreter (nothing compiles there).
    """
    if problem.serving or o.numel() == 0 or (compile_only and not _compiles_here(o)):
        return
    N, HV, K, V = problem.N, problem.HV, problem.K, problem.V
    if N * HV == 0:
        return
    q, k, v, g, beta = inputs[:5]
    h0, cu = inputs.initial_state, inputs.cu_seqlens
    B, T = q.shape[0], q.shape[1]
    BV, warps = launch_config(K, V, N * HV)
    dummy = o  # never dereferenced: the constexpr flags compile its uses away
    grid = flat_grid(cdiv(V, BV), N * HV)
    launch = functools.partial(recurrent_kernel.warmup, grid=grid) if compile_only else \
        functools.partial(enqueue, recurrent_kernel, grid)
    launch(
        q, k, v, g, beta,
        dummy if inputs.A_log is None else inputs.A_log, dummy if inputs.dt_bias is None else inputs.dt_bias,
        o, dummy if h0 is None else h0, dummy, dummy if cu is None else cu, dummy, dummy, dummy,
        problem.scale, T, B * T, N, 0, 0, 0, 1,
        H=problem.H, HV=HV, K=K, V=V, BK=next_power_of_2(K), BV=BV,
        IS_VARLEN=cu is not None, READ=READ_NONE if h0 is None else READ_DENSE, WRITE=WRITE_NONE,
        HAS_ACCEPTED=False, **option_flags(problem), TREE=False, REPAIR=True,
        num_warps=warps, num_stages=1,
    )
