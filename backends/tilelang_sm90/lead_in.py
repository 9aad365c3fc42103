"""Segment initial states by lead-in, for context parallelism (docs/algorithm.md section 4, the decay route).

Per token the state map is S -> e^{g_t} (I - beta_t k_t k_t^T) S + beta_t k_t v_t^T. Its linear part has
spectral norm at most b_t = e^{g_t} max(1, |1 - beta_t ||k_t||^2|) (the bracket is 1 for unit keys and beta
in [0, 2]). So the state at a segment's start depends on the state m chunks earlier only through a product of
norm <= exp(sum of log b_t over those m chunks). Once that sum is below log_bound (config.py, -12) for every
head, running just those m chunks from a zero state gives the segment's S0 to within e^log_bound of the earlier
state's size (e^-12 ~ 6e-6, where bf16 rounding is 4e-3). A lead-in that reaches back to its sequence's start is
exact (it starts from the sequence's initial state).

The forward's lead-in runs its own state kernel on the gathered lead-in chunks, a fixed few per segment
(fixed_lead_in: config.first_window chunks, or half a segment where that is less: plan.window), so it costs a
gather and a short launch, where the exact route (propagator.py + the segment scan) costs ~1.3 output passes.
Whether it settled each (segment, head) is decided on the device (transitions_needed), and the exact kernels run
behind it for the pairs it did not (the gated route, context_parallel.py). The chained route runs no separate
lead-in: its state passes walk, per (segment, head), as many chunks as the same bound needs (walk_lengths).
Nothing is read back, so CUDA graphs capture every route.

The backward's dS chain runs the transposes of the same per-token maps, right to left, so the same bound
gives each segment's dS_end from a lead-in over the chunks after it (reverse=True), run by the backward's
reverse-pass kernel from zero (from dht where it reaches the sequence's end), walked in place from each
segment's end (no gather), as few of the window's chunks as settle each head (reverse_lead_in).
"""
from __future__ import annotations

import dataclasses

import torch

from .config import current

CHUNK = 64


@dataclasses.dataclass(frozen=True)
class LeadInTables:
    """Host facts of a segment plan that the lead-ins need (built once per plan). The forward's lead-in runs
    the chunks before a segment (its initial state); the backward's the chunks after it (its dS_end)."""
    starts: torch.Tensor       # [n_seg] int64 device: each segment's first token
    ends: torch.Tensor         # [n_seg] int64 device: the token after its last
    seq_ends: torch.Tensor     # [n_seg] int64 device: the token after its sequence's last
    before: torch.Tensor       # [n_seg] int64 device: whole chunks between its sequence's start and it
    after: torch.Tensor        # [n_seg] int64 device: chunks between it and its sequence's end (a tail counts)
    seq_of: tuple[int, ...]    # each segment's sequence
    before_host: tuple[int, ...]
    after_host: tuple[int, ...]
    starts_host: tuple[int, ...]
    ends_host: tuple[int, ...]
    seq_ends_host: tuple[int, ...]
    chunk_rows_host: tuple[int, ...]  # each segment's first row of the chunk table (and of gamma)
    # what the walks' search reads (lead_in_bound.walk_lengths): each chunk-table row's tokens, whether a walk can
    # reach it (before its sequence's last segment; after its first with reverse), and each segment's rows
    row_starts: torch.Tensor          # [n_rows] int64 device: the row's first token
    row_ends: torch.Tensor            # [n_rows] int64 device: the token after its last
    walked: torch.Tensor              # [2, n_rows] int8 device: [0] forward walks reach it, [1] reverse ones
    chunk_rows: torch.Tensor          # [n_seg] int64 device: chunk_rows_host
    end_rows: torch.Tensor            # [n_seg] int64 device: the row of the chunk after each segment


def tables(seg_cu: list[int], seg_offsets: list[int], seg_chunk_rows: list[int], seq_starts: list[int],
           device: torch.device) -> LeadInTables:
    seq_of = [n for n in range(len(seg_offsets) - 1) for _ in range(seg_offsets[n], seg_offsets[n + 1])]
    starts, ends = seg_cu[:-1], seg_cu[1:]
    seq_ends = [seq_starts[n + 1] for n in seq_of]
    before = [(s - seq_starts[n]) // CHUNK for s, n in zip(starts, seq_of)]
    after = [-(-(se - e) // CHUNK) for e, se in zip(ends, seq_ends)]
    end_rows = [r + -(-(e - s) // CHUNK) for r, s, e in zip(seg_chunk_rows, starts, ends)]
    row_starts, row_ends = [], []
    for a, b in zip(seq_starts[:-1], seq_starts[1:]):
        row_starts += list(range(a, b, CHUNK))
        row_ends += [min(t + CHUNK, b) for t in range(a, b, CHUNK)]
    walked = torch.zeros(2, len(row_starts), dtype=torch.int8)
    for n in range(len(seg_offsets) - 1):
        first, last = seg_offsets[n], seg_offsets[n + 1] - 1
        if last > first:
            walked[0, seg_chunk_rows[first]:seg_chunk_rows[last]] = 1
            walked[1, end_rows[first]:end_rows[last]] = 1
    as_dev = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    return LeadInTables(as_dev(starts), as_dev(ends), as_dev(seq_ends), as_dev(before), as_dev(after),
                        tuple(seq_of), tuple(before), tuple(after), tuple(starts), tuple(ends), tuple(seq_ends),
                        tuple(seg_chunk_rows), as_dev(row_starts), as_dev(row_ends),
                        walked.to(device), as_dev(seg_chunk_rows), as_dev(end_rows))


@dataclasses.dataclass(frozen=True)
class LeadInLaunch:
    """The forward's gathered lead-in chunks as a packed problem of its own, one pseudo-sequence per segment with
    m > 0."""
    segments: tuple[int, ...]   # the segments it serves, in order
    tokens: torch.Tensor        # [n_tokens] int64: gather index into the packed tokens
    chunk_rows: torch.Tensor    # [n_chunks] int64: gather index into gamma's chunk rows
    cu_seqlens: torch.Tensor    # [n + 1] int32
    chunk_offsets: torch.Tensor  # [n + 1] int32
    exact: tuple[bool, ...]     # reaches its sequence's start: starts from h0


def launch(t: LeadInTables, m: list[int], device: torch.device) -> LeadInLaunch:
    segs = tuple(j for j, mj in enumerate(m) if mj > 0)
    tokens, rows, cu, co = [], [], [0], [0]
    for j in segs:
        first, last, row = t.starts_host[j] - CHUNK * m[j], t.starts_host[j], t.chunk_rows_host[j] - m[j]
        tokens.append(torch.arange(first, last))
        rows.append(torch.arange(row, row + m[j]))
        cu.append(cu[-1] + last - first)
        co.append(co[-1] + m[j])
    cat = lambda xs: (torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64)).to(device)  # noqa: E731
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    return LeadInLaunch(segs, cat(tokens), cat(rows), as_i32(cu), as_i32(co),
                        tuple(m[j] == t.before_host[j] for j in segs))


@dataclasses.dataclass(frozen=True)
class LeadInRun:
    """A lead-in launch and where its states go, as device index tensors: running it reads nothing back."""
    launch: LeadInLaunch
    m: tuple[int, ...]          # lead-in chunks per segment
    rows: torch.Tensor          # [len(launch.segments)] int64: the segments the launch serves
    ends: torch.Tensor          # int64: segments without a lead-in (a sequence's first)
    ends_seq: torch.Tensor      # int64: their sequences
    exact: torch.Tensor         # int64: rows of the launch whose lead-in reaches the sequence's start
    exact_seq: torch.Tensor     # int64: their sequences


def lead_in_run(t: LeadInTables, m: list[int] | tuple[int, ...], device: torch.device) -> LeadInRun:
    w = launch(t, list(m), device)
    ends = [j for j, mj in enumerate(m) if mj == 0]
    exact = [i for i, e in enumerate(w.exact) if e]
    as_dev = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    return LeadInRun(w, tuple(m), as_dev(list(w.segments)), as_dev(ends), as_dev([t.seq_of[j] for j in ends]),
                     as_dev(exact), as_dev([t.seq_of[w.segments[i]] for i in exact]))


def fixed_lead_in(t: LeadInTables, window: int, device: torch.device) -> LeadInRun:
    """The forward's lead-in: min(window, available) chunks before every segment, known from the host tables
    alone, so its launch is built with the segment plan (context_parallel.plan_segments) and a call, captured or
    not, reads nothing back. Whether it settled each (segment, head) is decided on the device
    (transitions_needed); the route covers the pairs it did not."""
    return lead_in_run(t, tuple(min(window, a) for a in t.before_host), device)


def transitions_needed(t: LeadInTables, g: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, window: int,
                       reverse: bool = False, row_sums: torch.Tensor | None = None,
                       log_bound: float | None = None) -> torch.Tensor:
    """[n_seg, HV] int32 on the device: 1 where a segment's transition is needed because the lead-in of
    min(window, available) chunks (fixed_lead_in; reverse_lead_in's window with reverse) leaves, for that head, the
    segment it hands its state to (the next one; the previous one with reverse) outside the bound; 0 elsewhere
    (the gated route's flags: context_parallel.py). row_sums: as reverse_lead_in's; log_bound: the plan's (default:
    the current Config's)."""
    from .lead_in_bound import transitions_needed as flags
    return flags(t.starts, t.ends, t.seq_ends, t.before, t.after, g, k, beta, window, reverse, _bound(log_bound),
                 None, row_sums, t.end_rows if reverse else t.chunk_rows)


def reverse_lead_in(t: LeadInTables, g: torch.Tensor, k: torch.Tensor, beta: torch.Tensor,
                   window: int, row_sums: torch.Tensor | None = None,
                   log_bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(walk, need), [n_seg, HV] int32 on the device, in one search: the backward's lead-in per segment and value
    head -- the fewest of the min(window, available) chunks after the segment whose bound is <= log_bound, all of
    them where none is (the reverse pass walks them in place from the segment's end, backward._gated_ds_ends) --
    and transitions_needed(..., reverse=True)'s flags for the pairs the window leaves unsettled. row_sums: the
    bound summed per chunk-table row, [n_chunks, HV] fp32, where the training forward's intra kernel wrote it
    (forward.Saved.row_bounds): read in place of summing the window's tokens again (one launch fewer)."""
    from .lead_in_bound import transitions_needed as flags
    walk = torch.empty(t.starts.shape[0], g.shape[2], dtype=torch.int32, device=g.device)
    need = flags(t.starts, t.ends, t.seq_ends, t.before, t.after, g, k, beta, window, True, _bound(log_bound),
                 walk, row_sums, t.end_rows)
    return walk, need


def walk_lengths(t: LeadInTables, g: torch.Tensor, k: torch.Tensor, beta: torch.Tensor,
                 reverse: bool = False, row_sums: torch.Tensor | None = None,
                 log_bound: float | None = None) -> torch.Tensor:
    """[n_seg, HV] int32 on the device: per segment and value head, the fewest whole chunks before the segment
    (after it with reverse) whose bound is <= log_bound -- run from zero, they give the segment's initial state
    (dS_end) within e^log_bound -- or all of them to the sequence's start (end): then exact, from h0 (dht). The
    chained route's walks (state_output_narrow.py, backward_state.py); nothing is read back. row_sums: the bound
    summed per chunk-table row, [n_chunks, HV] fp32, where the intra kernel wrote it (emit_bound)."""
    from .lead_in_bound import walk_lengths as search
    return search(t, g, k, beta, reverse, _bound(log_bound), row_sums)


def _bound(log_bound: float | None) -> float:
    """The decay bound's log: the plan's where given, else the current Config's."""
    return current().log_bound if log_bound is None else log_bound


def run_states(wr: LeadInRun, boundary: torch.Tensor | None, shape: tuple[int, int, int], device: torch.device,
               run) -> torch.Tensor:
    """Every segment's state at its lead-in end [n_seg, HV, K, V] fp32 -- the forward's initial states: a
    sequence's first segment gets the sequence's boundary state (h0; zero where None); the others `run(launch,
    init)` over their lead-in chunks, from zero, or from the boundary state where the lead-in reaches the
    sequence's start."""
    out = torch.zeros(len(wr.m), *shape, device=device, dtype=torch.float32)
    if boundary is not None and wr.ends.numel():
        out.index_copy_(0, wr.ends, boundary.index_select(0, wr.ends_seq))
    if wr.launch.segments:
        init = torch.zeros(len(wr.launch.segments), *shape, device=device, dtype=torch.float32)
        if boundary is not None and wr.exact.numel():
            init.index_copy_(0, wr.exact, boundary.index_select(0, wr.exact_seq))
        out.index_copy_(0, wr.rows, run(wr.launch, init))
    return out
