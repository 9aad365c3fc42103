"""The fused backward's dq / dk, written per chunk and value head (backward_fused.py: dqk [n_chunks, HV, 2, 64, K],
dq's [64, 128] then dk's, each in the order slot_offset gives, in S0's buffer), summed over each key head's group of
value heads (GVA) in value head order with fp32 sums and written in the gradients' dtype at their tokens: one
Triton launch for both. torch's reduction over the group dimension and the cast after it took 0.76 ms of the fused
path's 4.7 at 16/32 1x32768 (both tensors; H200, per-kernel profile), ~3x what their ~0.8 GB of reads and writes
take at the HBM's rate. At 8 warps a program it reads and writes at ~4.1 TB/s (H200: 0.198 ms at 16/32
1x32768, 4 warps 0.199, a grid split over dq / dk no faster). The same launch can also take the gate floor's
backward on dg (gate_floor below): the two small launches of its torch form (a comparison and a select) leave
an eager backward."""
from __future__ import annotations

import torch

from gdnkit import prep, seqlayout
from gdnkit.prologue import l2norm_backward_fp32, triton_reads

try:
    import triton
    import triton.language as tl

    from ..triton_shared.launch import enqueue
except ImportError:  # the torch form below serves
    triton = None


def accumulator_thread(r, j):
    """The thread of a warpgroup (0-127) that holds element (r, j) of a 64-row wgmma accumulator (m64nN: warp r // 16,
    lane r % 8 * 4 + j % 8 // 2). r, j: ints, tensors or TileLang's index expressions."""
    return (r // 16) * 32 + r % 8 * 4 + j % 8 // 2


def slot_offset(r, j):
    """Where element (r, j) of a chunk's [64, 128] dq or dk goes in its 8192-element slot of dqk: the order the fused
    kernel's g and p accumulators hold it in (wgmma's m64n128 layout: thread accumulator_thread(r, j), its
    value (j // 8) * 4 + r % 16 // 8 * 2 + j % 2), as [8 value blocks, 128 threads, 8 values], so that each thread
    stores 8 values at once and a warp's 32 threads 512 contiguous bytes (row-major, g made 32 stores of 4 bytes a
    thread, ~2000 clocks of its chunk in a clock64 trace). r, j: ints, tensors or TileLang's index expressions.
    Digits of the offset, most significant first: j // 16, r // 16, r % 8, j % 8 // 2, j % 16 // 8, r % 16 // 8,
    j % 2 (sizes 8, 4, 8, 4, 2, 2, 2): _SLOT_TO_ROWS below permutes them back to r's then j's."""
    return (j // 16) * 1024 + accumulator_thread(r, j) * 8 + (j % 16 // 8) * 4 + (r % 16 // 8) * 2 + j % 2


# the slot's digits and their permutation back to rows (r // 16, r % 16 // 8, r % 8, j // 16, j % 16 // 8,
# j % 8 // 2, j % 2); the Triton kernel spells the same two tuples out
_SLOT_DIGITS = (8, 4, 8, 4, 2, 2, 2)
_SLOT_TO_ROWS = (1, 5, 2, 0, 4, 3, 6)


def rows_from_slot(flat: torch.Tensor) -> torch.Tensor:
    """[..., 8192] slots in slot_offset's order -> [..., 64, 128] rows."""
    lead = flat.shape[:-1]
    x = flat.reshape(*lead, *_SLOT_DIGITS).permute(*range(len(lead)), *(len(lead) + d for d in _SLOT_TO_ROWS))
    return x.reshape(*lead, 64, 128)


def chunk_group_sums(dqk: torch.Tensor, layout, H: int, total: int, dtype: torch.dtype,
                     runs: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                     l2norm: tuple[torch.Tensor, ...] | None = None,
                     gate_floor: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """dqk [n_chunks, HV, 2, C, K] -> (dq, dk) [1, total, H, K] in dtype: each token's rows from its chunk's slots
    (layout: seqlayout.SequenceLayout, whose chunks dqk's are; a tail chunk's rows past its sequence are summed
    with the rest, the slots being read whole, and not stored), each key head's HV // H value heads summed in order
    in fp32. Tokens past the last sequence are zero. runs: (cu_seqlens, chunk_offsets, most chunks of one) of the
    fused kernel's programs (sequences or segments; layout's sequences by default), whose chunks the launch takes
    in the order the kernel wrote them last first (below). l2norm: (q_raw, q_rstd, k_raw, k_rstd) of the prologue's
    qk l2norm ([1, total, H, K] and [1, total, H, 1] fp32, or any shape of the same elements): the sums are then
    the gradients of the normalised q and k, and each leaves as its raw input's, rstd (dy - y (y . dy)) with y
    made again from x and rstd, still in fp32, so that nothing is written in fp32 for the prologue's backward to
    read again (gdnkit/prologue.py's torch form, and triton_shared/l2norm.py's pass: 2.1 -> 1.1 GB moved at
    16/32 1x32768). gate_floor: (g, dg), the prologue's log-gate before its floor and the fused kernel's dg w.r.t.
    the floored gate ([1, total, HV] fp32, or any shape of the same elements): dg is made w.r.t. g in place, as
    prep.floor_gate_backward makes it (zero at every token of a run whose g is below prep.GATE_FLOOR or NaN; the
    tokens past the last sequence are left as they are), by the same programs, one (run, key head, chunk) each for
    its value heads' rows."""
    n_chunks, HV, _, C, K = dqk.shape
    assert (C, K) == (64, 128), "slot_offset's order is for [64, 128] slots"
    dq, dk = (seqlayout.packed_output((1, total, H, K), layout.cu_seqlens, device=dqk.device, dtype=dtype)
              for _ in range(2))
    if not n_chunks:
        return dq, dk
    if gate_floor is not None:
        g_raw, dg = gate_floor
        assert g_raw.numel() == dg.numel() == total * HV and dg.is_contiguous() and dg.dtype == torch.float32
        g_raw = g_raw.contiguous()
    if l2norm is not None:
        q_raw, q_rstd, k_raw, k_rstd = (t.contiguous() for t in l2norm)
        assert q_raw.numel() == k_raw.numel() == total * H * K and q_rstd.numel() == k_rstd.numel() == total * H
    if not triton_reads(dqk):
        _sums_torch(dqk, layout, H, dq, dk, l2norm)
        if gate_floor is not None:
            _floor_torch(g_raw, dg, layout.cu_seqlens, HV)
    else:
        cu, offsets, longest = runs or (layout.cu_seqlens, layout.chunk_offsets, max(layout.chunk_counts))
        norm = (q_raw, q_rstd, k_raw, k_rstd) if l2norm is not None else (dq, dq, dq, dq)   # never read without
        floor = (g_raw, dg) if gate_floor is not None else (dq, dq)                          # likewise
        for w0 in range(0, longest, _MAX_GRID_Z):   # one launch below 4.2M tokens a run
            enqueue(_chunk_group_sums_kernel, (offsets.shape[0] - 1, H, min(longest - w0, _MAX_GRID_Z)),
                    dqk, cu, offsets, dq, dk, *norm, *floor, w0, H=H, G=HV // H, C=C, K=K,
                    L2NORM=l2norm is not None, FLOOR=gate_floor is not None, GATE_FLOOR=prep.GATE_FLOOR,
                    num_warps=8)
    return dq, dk


def _floor_torch(g_raw: torch.Tensor, dg: torch.Tensor, cu_seqlens: torch.Tensor, HV: int) -> None:
    """The gate floor's backward in place over the sequences' tokens (chunk_group_sums' gate_floor, torch form):
    token-major rows of HV entries, whatever shape the two tensors come in."""
    end = int(cu_seqlens[-1])
    flat_g, flat_dg = g_raw.reshape(-1, HV)[:end], dg.view(-1, HV)[:end]
    flat_dg.copy_(prep.floor_gate_backward(flat_g, flat_dg))


_MAX_GRID_Z = 65535   # CUDA's limit on a grid's third axis


def _sums_torch(dqk, layout, H, dq, dk, l2norm=None):
    n_chunks, HV, _, C, K = dqk.shape
    seq, within = layout.chunk_indices.long().unbind(1)
    cu = layout.cu_seqlens.long()
    tokens = cu[seq][:, None] + within[:, None] * C + torch.arange(C, device=dqk.device)   # [n_chunks, C]
    valid = tokens < cu[seq + 1][:, None]
    sums = dqk.view(n_chunks, H, HV // H, 2, C, K).float().sum(2)                            # [n_chunks, H, 2, C, K]
    sums = rows_from_slot(sums.reshape(n_chunks, H, 2, C * K))
    for which, out in enumerate((dq, dk)):
        rows = sums[:, :, which].transpose(1, 2)[valid]                                       # [tokens, H, K]
        if l2norm is not None:
            x, rstd = (t.reshape(-1, H, t.shape[-1])[tokens[valid]] for t in l2norm[2 * which:2 * which + 2])
            rows = l2norm_backward_fp32(x, rstd, rows)
        out[0, tokens[valid]] = rows.to(out.dtype)


if triton is not None:
    @triton.jit
    def _chunk_group_sums_kernel(dqk, cu_seqlens, chunk_offsets, dq, dk, q_raw, q_rstd, k_raw, k_rstd, g_raw, dg,
                                 w0, H: tl.constexpr, G: tl.constexpr, C: tl.constexpr, K: tl.constexpr,
                                 L2NORM: tl.constexpr, FLOOR: tl.constexpr, GATE_FLOOR: tl.constexpr):
        """One program per (run, key head, chunk w of the run): its G value heads' dq slots added in order (in
        slot_offset's order: all 64 rows are the kernel's, a tail's too), then their dk slots. w is the grid's
        slowest axis, so the launch starts with every run's first chunks: the fused kernel walks its runs right to
        left, so those are the slots it wrote last, the ones still in L2 (H200, device time: 0.194 ->
        0.186 ms at 16/32 1x32768, 0.050 -> 0.048 at 16/32 1x8192, against chunks in table order; 4/8 1x8192's
        34 MB of slots fit L2 either way)."""
        n = tl.program_id(0)
        h = tl.program_id(1)
        w = w0 + tl.program_id(2)
        c0 = tl.load(chunk_offsets + n)
        if w >= tl.load(chunk_offsets + n + 1) - c0:
            return
        c = c0 + w
        t0 = tl.load(cu_seqlens + n) + w * C
        r = tl.arange(0, C)
        k = tl.arange(0, K)
        inside = t0 + r < tl.load(cu_seqlens + n + 1)
        m = inside[:, None]
        rows = (t0 + r).to(tl.int64)[:, None]
        for which in tl.static_range(2):
            flat = tl.zeros([C * K], dtype=tl.float32)
            for j in tl.static_range(G):
                slot = ((c * (H * G) + h * G + j) * 2 + which).to(tl.int64) * (C * K)
                flat += tl.load(dqk + slot + tl.arange(0, C * K)).to(tl.float32)
            acc = tl.reshape(tl.permute(tl.reshape(flat, (8, 4, 8, 4, 2, 2, 2)), (1, 5, 2, 0, 4, 3, 6)), (C, K))
            if L2NORM:   # the qk l2norm's backward (chunk_group_sums' docstring)
                x = q_raw if which == 0 else k_raw
                rstd = tl.load((q_rstd if which == 0 else k_rstd) + rows * H + h, mask=m, other=0.0)
                y = tl.load(x + (rows * H + h) * K + k[None, :], mask=m, other=0.0).to(tl.float32) * rstd
                acc = rstd * (acc - y * tl.sum(y * acc, axis=1)[:, None])
            out = dq if which == 0 else dk
            tl.store(out + (rows * H + h) * K + k[None, :], acc.to(out.dtype.element_ty), mask=m)
        if FLOOR:   # the gate floor's backward on this chunk's rows of the group's dg (chunk_group_sums' docstring)
            for j in tl.static_range(G):
                at = (t0 + r).to(tl.int64) * (H * G) + h * G + j
                d = tl.load(dg + at, mask=inside, other=0.0)
                gate = tl.load(g_raw + at, mask=inside, other=0.0)
                tl.store(dg + at, tl.where(gate >= GATE_FLOOR, d, 0.0), mask=inside)
