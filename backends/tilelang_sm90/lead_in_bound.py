"""The decay bound's tests on the device (lead_in.py says why the bound suffices), each in two Triton launches:
lead_in.transitions_needed, per (segment, value head) whether a lead-in of fixed length (lead_in.fixed_lead_in)
brings the summed norm bound below LOG_BOUND, and the flag of the segment whose transition is needed where it
does not (lead_in.reverse_lead_in: also the fewest of those chunks that do); lead_in.walk_lengths, per (segment,
value head) the fewest chunks next to the segment that do, or all of them to the sequence's boundary (the chained
route's walks).

    1. chunk sums: the bound's log summed per chunk and value head (float64), each program one chunk's 64 tokens
       and one key head's group: for the flags per (segment, chunk of its fixed window) into [n_seg, window, HV];
       for the walks once per chunk-table row a walk can reach, into [n_rows, HV], which every segment of the
       sequence reads (summed per segment instead, each recomputed all the chunks before it, ~n_seg / 2 times the
       sequence's k, 0.055 ms of 2/8 1x32768's 0.234 with 16 segments);
    2. one program per segment: the window's sums added, the test per head (the flags), or running sums over
       blocks of 64 chunks, nearest first, and the first count that settles each head (the walks).

Why two launches (H200): one program per segment walking its window 16 tokens and one key head at a time cost
0.13-0.40 ms a call (4/8 1x8192 to 16/32 1x32768, eager), latency-bound: ~16 dependent small loads per chunk and
head. The PyTorch form before it (gathers, float64 casts, a sum per chunk, a cumulative sum) was ~35 small ops and
host reads. Here the loads are spread over programs and each is one 64-token tile. (The chained
route's walks need no search for the shortest settling lead-in, which a route that read its lengths back had.)

Imported only where context parallelism runs (context_parallel.available: triton importable)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_shared.launch import enqueue

CHUNK = tl.constexpr(64)  # a jit-visible global must be constexpr (the interpreter does not check it)


@triton.jit
def _tile_log_bound(g, k, beta, tok, inside, h, n_tok, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                    GP: tl.constexpr, KP: tl.constexpr):
    """([GP] float64 sums over the tile's tokens `tok` where `inside` of log b_t = g_t + log max(1,
    |1 - beta_t ||k_t||^2|) for key head h's value heads (||k_t||^2 in fp32, as the PyTorch definition in
    tests/test_lead_in.py); tokens outside add 0 and load nothing, [GP] value heads, their mask)."""
    GROUP: tl.constexpr = HV // H
    tok = tl.minimum(tl.maximum(tok, 0), n_tok - 1)
    ck = tl.arange(0, KP)
    kt = tl.load(k + (tok[:, None] * H + h) * K + ck[None, :], mask=inside[:, None] & (ck < K)[None, :],
                 other=0.0).to(tl.float32)
    kk = tl.sum(kt * kt, 1)
    gi = tl.arange(0, GP)
    mg = gi < GROUP
    hv = h * GROUP + gi
    gg = tl.load(g + tok[:, None] * HV + hv[None, :], mask=inside[:, None] & mg[None, :], other=0.0).to(tl.float64)
    bb = tl.load(beta + tok[:, None] * HV + hv[None, :], mask=inside[:, None] & mg[None, :], other=0.0).to(tl.float64)
    stretch = tl.log(tl.maximum(tl.abs(1.0 - bb * kk.to(tl.float64)[:, None]), 1.0))
    return tl.sum(tl.where(inside[:, None], gg + stretch, 0.0), 0), hv, mg


@triton.jit
def _chunk_bounds_kernel(g, k, beta, starts, ends, seq_ends, before, sums, limit, n_tok,
                         H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, GP: tl.constexpr, KP: tl.constexpr,
                         REVERSE: tl.constexpr):
    """sums[j, m, hv] = the bound's log summed over chunk m away from segment j (before it; after it with
    REVERSE), float64; tokens outside the sequence add 0."""
    j = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1)
    h = tl.program_id(2)
    row = tl.arange(0, CHUNK).to(tl.int64)
    if REVERSE:
        tok = tl.load(ends + j) + m * CHUNK + row
        inside = tok < tl.load(seq_ends + j)
    else:
        start = tl.load(starts + j)
        tok = start - 1 - m * CHUNK - row
        inside = tok >= start - CHUNK * tl.load(before + j)
    s, hv, mg = _tile_log_bound(g, k, beta, tok, inside, h, n_tok, H, HV, K, GP, KP)
    tl.store(sums + (j * limit + m) * HV + hv, s, mask=mg)


@triton.jit
def _row_bounds_kernel(g, k, beta, row_starts, row_ends, walked, sums, n_tok, H: tl.constexpr, HV: tl.constexpr,
                       K: tl.constexpr, GP: tl.constexpr, KP: tl.constexpr):
    """sums[r, hv] = the bound's log summed over chunk-table row r's tokens, float64, for the rows a walk can
    reach (walked[r]); the others load nothing and store 0 (never read)."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    tok = tl.load(row_starts + r) + tl.arange(0, CHUNK).to(tl.int64)
    reached = tok * 0 + tl.load(walked + r).to(tl.int64) != 0   # as a tile: a scalar mask the interpreter refuses
    inside = (tok < tl.load(row_ends + r)) & reached
    s, hv, mg = _tile_log_bound(g, k, beta, tok, inside, h, n_tok, H, HV, K, GP, KP)
    tl.store(sums + r * HV + hv, s, mask=mg)


@triton.jit
def _needs_kernel(sums, base, before, after, need, walk, window, stride, HV: tl.constexpr, HVP: tl.constexpr,
                  REVERSE: tl.constexpr, LOG_BOUND: tl.constexpr, WALK: tl.constexpr, ROWS: tl.constexpr):
    """Segment j's lead-in of exactly m = min(window, chunks available) chunks, per value head: settled if it
    reaches the sequence's start (end) or its summed bound is <= LOG_BOUND. Where a head is not settled, the
    exact route needs the transition of the segment that hands segment j its state -- the one before it (after
    it with REVERSE) -- so need[that segment, head] = 1; else 0. sums: [n_seg, stride, HV], or with ROWS
    [n_rows, HV] per chunk-table row, segment j's i-th chunk at row base[j] - 1 - i (base[j] + i with REVERSE:
    base is its first row, or the row after it), as walk_lengths reads them. WALK: also
    walk[j, hv], the first count of those m chunks (nearest first) whose summed bound is <= LOG_BOUND, else m: a
    walk that long settles the pair wherever the flag says the m chunks do (the same sum, or a shorter one)."""
    j = tl.program_id(0).to(tl.int64)
    hv = tl.arange(0, HVP)
    mh = hv < HV
    avail = tl.load(after + j) if REVERSE else tl.load(before + j)
    m = tl.minimum(avail, window)
    total = tl.zeros([HVP], dtype=tl.float64)
    first = tl.zeros([HVP], dtype=tl.int32) + m
    row0 = j * stride
    step = 1
    if ROWS:
        row0 = tl.load(base + j)
        if not REVERSE:   # the chunks before the segment, nearest first
            row0 -= 1
            step = -1
    for i in range(0, m):
        total += tl.load(sums + (row0 + step * i) * HV + hv, mask=mh, other=0.0).to(tl.float64)
        if WALK:
            first = tl.where((first == m) & (total <= LOG_BOUND), i + 1, first)
    if WALK:
        tl.store(walk + j * HV + hv, first, mask=mh)
    unsettled = (m < avail) & (total > LOG_BOUND)
    src = j + 1 if REVERSE else j - 1       # in j's sequence wherever avail > 0
    has_src = (hv * 0 + avail) > 0          # as a [HVP] mask: a scalar one is not a mask the interpreter takes
    tl.store(need + src * HV + hv, tl.where(unsettled, 1, 0).to(tl.int32), mask=mh & has_src)
    # need[j] itself is written above by the segment on j's other side in its sequence, where there is one; where
    # there is none (j ends its sequence in that direction) it is 0, written here: every entry once, no zero fill
    other_side = tl.load(before + j) if REVERSE else tl.load(after + j)
    tl.store(need + j * HV + hv, tl.zeros([HVP], dtype=tl.int32), mask=mh & ((hv * 0 + other_side) == 0))


@triton.jit
def _walks_kernel(sums, base, before, after, walk, HV: tl.constexpr, HVP: tl.constexpr, BM: tl.constexpr,
                  REVERSE: tl.constexpr, LOG_BOUND: tl.constexpr):
    """walk[j, hv]: the first m in 1 .. avail whose running sum of segment j's chunk sums (nearest first) is <=
    LOG_BOUND for head hv, else avail (the walk reaches the sequence's boundary: exact); 0 where avail is 0.
    sums: [n_rows, HV] per chunk-table row; segment j's m-th chunk is row base[j] - 1 - m (its first row as base),
    base[j] + m with REVERSE (the row after it). The blocks stop once every head has its count: a later block's
    counts are larger, so the walk is the same (H200: a sequence's last segments read every block to
    its start, 12-14 us at 1x32768 where each head settled in the first block)."""
    j = tl.program_id(0).to(tl.int64)
    hv = tl.arange(0, HVP)
    mh = hv < HV
    avail = tl.load(after + j) if REVERSE else tl.load(before + j)
    row0 = tl.load(base + j)
    carry = tl.zeros([HVP], dtype=tl.float64)
    first = tl.zeros([HVP], dtype=tl.int64) + avail       # until a block settles the head
    m0 = avail * 0
    unsettled = avail > 0
    while unsettled:
        mm = m0 + tl.arange(0, BM).to(tl.int64)
        inside = (mm < avail)[:, None] & mh[None, :]
        rows = row0 + mm if REVERSE else row0 - 1 - mm
        blk = tl.load(sums + rows[:, None] * HV + hv[None, :], mask=inside, other=0.0).to(tl.float64)
        run = tl.cumsum(blk, 0) + carry[None, :]
        hit = tl.min(tl.where(inside & (run <= LOG_BOUND), mm[:, None] + 1, avail), 0)
        first = tl.minimum(first, hit)
        carry += tl.sum(blk, 0)
        m0 += BM
        # a head still at avail has no count yet (or its count is the last chunk, in this block: m0 >= avail)
        unsettled = (m0 < avail) & (tl.max(tl.where(mh, first, 0), 0) == avail)
    tl.store(walk + j * HV + hv, first.to(tl.int32), mask=mh)


def _chunk_sums(starts, ends, seq_ends, before, g, k, beta, limit: int, reverse: bool) -> torch.Tensor:
    """[n_seg, max(limit, 1), HV] float64: the bound's log summed per chunk of each segment's window of `limit`
    chunks."""
    _, n_tok, HV = g.shape
    H, K = k.shape[2], k.shape[3]
    n_seg = starts.shape[0]
    sums = torch.empty(n_seg, max(limit, 1), HV, dtype=torch.float64, device=g.device)
    if limit > 0 and n_seg > 0:
        enqueue(_chunk_bounds_kernel, (n_seg, limit, H), g, k, beta, starts, ends, seq_ends, before, sums, limit,
                n_tok, H=H, HV=HV, K=K, GP=triton.next_power_of_2(HV // H), KP=triton.next_power_of_2(K),
                REVERSE=reverse, num_warps=4)
    return sums


def transitions_needed(starts: torch.Tensor, ends: torch.Tensor, seq_ends: torch.Tensor, before: torch.Tensor,
                       after: torch.Tensor, g: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, window: int,
                       reverse: bool, log_bound: float, walk: torch.Tensor | None = None,
                       row_sums: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """[n_seg, HV] int32 on the device: 1 where a (segment, head)'s transition is needed because a lead-in of
    min(window, available) chunks leaves its neighbour (after it; before it with reverse) outside the bound
    (lead_in.transitions_needed's test, read by the gated route's exact kernels; nothing is read back). walk
    ([n_seg, HV] int32): also the fewest of those chunks that settle each pair (_needs_kernel), written there.
    row_sums ([n_rows, HV] fp32, as the intra kernel's emit_bound writes them) with rows (each segment's first
    chunk-table row; the row after it with reverse): the window's chunk sums read from there, one launch fewer
    (the per-token sums in float64 here, per row in fp32 there: a head at the bound's edge may get one chunk more
    or less, either within the bound)."""
    n_seg, HV = starts.shape[0], g.shape[2]
    need = torch.empty(n_seg, HV, dtype=torch.int32, device=g.device)   # every entry written by _needs_kernel
    if n_seg:
        by_rows = row_sums is not None
        sums = row_sums if by_rows else _chunk_sums(starts, ends, seq_ends, before, g, k, beta, window, reverse)
        # (base, the second argument, is unread without ROWS)
        enqueue(_needs_kernel, (n_seg,), sums, rows if by_rows else before, before, after, need,
                need if walk is None else walk, window, 0 if by_rows else sums.shape[1],
                HV=HV, HVP=triton.next_power_of_2(HV), REVERSE=reverse, LOG_BOUND=log_bound,
                WALK=walk is not None, ROWS=by_rows, num_warps=1)
    return need


def walk_lengths(t, g: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, reverse: bool,
                 log_bound: float, row_sums: torch.Tensor | None = None) -> torch.Tensor:
    """[n_seg, HV] int32 on the device (lead_in.walk_lengths' contract) from the plan's lead_in.LeadInTables t;
    row_sums: the chunk sums per chunk-table row as the intra kernel wrote them (its emit_bound), else they are
    summed here."""
    n_seg, n_rows = t.starts.shape[0], t.row_starts.shape[0]
    _, n_tok, HV = g.shape
    H, K = k.shape[2], k.shape[3]
    walk = torch.empty(n_seg, HV, dtype=torch.int32, device=g.device)
    if n_seg:
        sums = row_sums
        if sums is None:
            sums = torch.empty(max(n_rows, 1), HV, dtype=torch.float64, device=g.device)
            if n_rows:
                enqueue(_row_bounds_kernel, (n_rows, H), g, k, beta, t.row_starts, t.row_ends, t.walked[int(reverse)],
                        sums, n_tok, H=H, HV=HV, K=K, GP=triton.next_power_of_2(HV // H),
                        KP=triton.next_power_of_2(K), num_warps=4)
        enqueue(_walks_kernel, (n_seg,), sums, t.end_rows if reverse else t.chunk_rows, t.before, t.after, walk,
                HV=HV, HVP=triton.next_power_of_2(HV), BM=64, REVERSE=reverse, LOG_BOUND=log_bound, num_warps=4)
    return walk


@triton.jit
def _pick_kernel(walk, own, seg_cu, cu, wide_cu, wide_walk, plain_cu, choice, n_seg, n_cu, longest, ratio,
                 HV: tl.constexpr, HVP: tl.constexpr, BS: tl.constexpr):
    """One program: wide = max over (segment, head) of (own chunks + walk) * ratio < longest; then the wide
    route's cu_seqlens and walks (kept where wide, zero where not) and the plain pass's cu_seqlens (zero where
    wide): each pass launched behind it runs only where it was picked, and nothing is read back."""
    hv = tl.arange(0, HVP)
    mh = hv < HV
    worst = tl.full([], 0, tl.int32)
    for j0 in range(0, n_seg, BS):
        j = j0 + tl.arange(0, BS)
        mj = j < n_seg
        w = tl.load(walk + j[:, None] * HV + hv[None, :], mask=mj[:, None] & mh[None, :], other=0)
        o = tl.load(own + j, mask=mj, other=0)
        worst = tl.maximum(worst, tl.max(tl.max(w + o[:, None], 1), 0))
    wide = worst.to(tl.float32) * ratio < longest
    tl.store(choice, wide)
    for j0 in range(0, n_seg, BS):
        j = j0 + tl.arange(0, BS)
        m = (j < n_seg)[:, None] & mh[None, :]
        w = tl.load(walk + j[:, None] * HV + hv[None, :], mask=m, other=0)
        tl.store(wide_walk + j[:, None] * HV + hv[None, :], tl.where(wide, w, 0), mask=m)
    for j0 in range(0, n_seg + 1, BS):
        j = j0 + tl.arange(0, BS)
        mj = j < n_seg + 1
        tl.store(wide_cu + j, tl.where(wide, tl.load(seg_cu + j, mask=mj, other=0), 0), mask=mj)
    for j0 in range(0, n_cu, BS):
        j = j0 + tl.arange(0, BS)
        mj = j < n_cu
        tl.store(plain_cu + j, tl.where(wide, 0, tl.load(cu + j, mask=mj, other=0)), mask=mj)


def pick_wide(walk: torch.Tensor, own: torch.Tensor, seg_cu: torch.Tensor, cu: torch.Tensor, longest: int,
              ratio: float):
    """(wide_cu, wide_walk, plain_cu, choice) on the device (context_parallel.pick's contract), one launch."""
    n_seg, HV = walk.shape
    wide_cu, wide_walk, plain_cu = torch.empty_like(seg_cu), torch.empty_like(walk), torch.empty_like(cu)
    choice = torch.empty((), dtype=torch.bool, device=walk.device)
    enqueue(_pick_kernel, (1,), walk, own, seg_cu, cu, wide_cu, wide_walk, plain_cu, choice, n_seg, cu.shape[0],
            float(longest), float(ratio), HV=HV, HVP=triton.next_power_of_2(HV), BS=64, num_warps=4)
    return wide_cu, wide_walk, plain_cu, choice
