"""The problem spec: one validated description of a GDN call that every backend reads.

`validate_inputs` is the one place that decides what a call means (FLA 0.6.0 semantics) and
rejects bad input with a ValueError/TypeError naming the argument, before any kernel runs.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from typing import NamedTuple

import torch

from gdnkit import seqlayout
from gdnkit.prep import CHUNK as CHUNK_SIZE

CHUNK_MODE = "chunk"
RECURRENT_MODE = "recurrent"

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class GDNInputs(NamedTuple):
    """The tensors of a call as the user passed them (options not yet applied; kernels fuse them)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    initial_state: torch.Tensor | None
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    cu_seqlens: torch.Tensor | None


class GDNServingInputs(NamedTuple):
    """GDNInputs plus the serving interface's tensors; only serving problems (problem.serving) carry it.

    A separate tuple rather than two more GDNInputs fields: serving is inference-only, so it never meets
    the autograd glue, and backends that unpack GDNInputs positionally keep working.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    initial_state: torch.Tensor  # the state pool [num_slots, HV, K, V] (or [.., V, K])
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    ssm_state_indices: torch.Tensor  # [N] or [N, C] int32/int64, -1 = padding / no write
    num_accepted_tokens: torch.Tensor | None  # [N] int32/int64, with 2-D indices only
    # chunked prefill on the pool only:
    has_initial_state: torch.Tensor | None = None  # [N] bool: False = a new sequence, starts from zero
    checkpoint_indices: torch.Tensor | None = None  # [N, C] int32/int64: slot of the state after (j+1)*every tokens
    # tree verify (fused_recurrent with 2-D indices) only:
    parent_indices: torch.Tensor | None = None  # [N, C] int32/int64: token t continues from token parent[n, t]


class GDNGrads(NamedTuple):
    """Gradients a backend's backward returns, in the order of GDNInputs (None where not needed)."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dinitial_state: torch.Tensor | None
    dA_log: torch.Tensor | None
    ddt_bias: torch.Tensor | None


@dataclasses.dataclass(frozen=True)
class Problem:
    """Shapes, dtypes, device and options of one call: what `supports()` decides on."""

    mode: str  # CHUNK_MODE or RECURRENT_MODE
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int  # number of sequences: B, or len(cu_seqlens) - 1
    dtype: torch.dtype  # of q/k/v
    gate_dtype: torch.dtype  # of g and beta
    device_type: str
    device_index: int | None
    scale: float
    varlen: bool
    has_initial_state: bool
    state_dtype: torch.dtype | None
    output_final_state: bool
    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    has_dt_bias: bool = False
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    state_v_first: bool = False
    needs_grad: bool = False
    # The serving interface (fused_recurrent only): initial_state is a pool of num_slots states that
    # ssm_state_indices maps sequences to; per_token_slots: 2-D indices, the state after every token is
    # written to its own slot (rollback of speculative tokens).
    serving: bool = False
    num_slots: int = 0
    per_token_slots: bool = False
    has_num_accepted_tokens: bool = False
    inplace_final_state: bool = False
    # Chunked prefill on the pool: per-sequence "starts from its slot" flags, and the prefix-cache checkpoint
    # interval in tokens (0: no checkpoints).
    has_start_flags: bool = False
    checkpoint_every: int = 0
    # Tree verify: 2-D indices with parent_indices (token t continues from the state after its parent token).
    has_parents: bool = False

    @property
    def compute_dtype(self) -> torch.dtype:
        """float64 inputs are computed in float64, everything else in float32."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        return (self.N, self.HV, self.V, self.K) if self.state_v_first else (self.N, self.HV, self.K, self.V)

    def describe(self) -> str:
        seq = f"varlen N={self.N} T={self.T}" if self.varlen else f"B={self.B} T={self.T}"
        return (f"{self.mode} {seq} H={self.H} HV={self.HV} K={self.K} V={self.V} "
                f"{str(self.dtype).removeprefix('torch.')} on {self.device_type}"
                f"{'' if self.device_index is None else ':' + str(self.device_index)}"
                f"{' +grad' if self.needs_grad else ''}"
                f"{f' serving pool of {self.num_slots} slots' if self.serving else ''}")


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(map(str, t.shape)) + "]"


def _require_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _require_rank(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name} must have rank {rank} ({layout}), got shape {_shape(t)}")


def _require_shape(name: str, t: torch.Tensor, expected: tuple[int, ...], layout: str) -> None:
    if tuple(t.shape) != tuple(expected):
        want = "[" + ", ".join(map(str, expected)) + "]"
        raise ValueError(f"{name} must have shape {layout} = {want}, got {_shape(t)}")


def _head_first_hint(q: torch.Tensor, v: torch.Tensor, *gates: torch.Tensor) -> str | None:
    """What to say when q/k/v read consistently as the head-first layout [B, H, T, K] (FLA's old
    head_first=True), with fewer heads than tokens; None when they do not."""
    if v.dim() != 4:
        return None
    B, H, T, HV = q.shape[0], q.shape[1], q.shape[2], v.shape[1]
    if not (v.shape[0] == B and v.shape[2] == T and 0 < H < T and HV % H == 0):
        return None
    if any(tuple(x.shape) not in ((B, T, HV), (B, HV, T)) for x in gates):
        return None
    return (f"q, k and v look head-first: q {_shape(q)} and v {_shape(v)} read as [B, H, T, K] and [B, HV, T, V] "
            f"with H={H}, HV={HV} heads and T={T} tokens. gdnkit takes FLA's [B, T, H, K] layout (sequence before "
            f"heads): pass q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), and g and beta as [B, T, HV]")


class PositiveGateWarning(UserWarning):
    """g > 0 without use_gate_in_kernel: the state grows by exp(g) per token instead of decaying."""


# Frames of these directories are the library's public calls (and torch.compiler.disable's wrapper around them): a
# warning names the first frame outside them, so Python's default filter shows it once per call site in user code.
_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
                 os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def _caller_stacklevel() -> int:
    frame, level = sys._getframe(1), 1  # level 1: the function calling warnings.warn, our caller
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def warn_positive_gates(problem: Problem, g: torch.Tensor) -> None:
    """g is a log-space decay: g > 0 (without use_gate_in_kernel) grows the state by exp(g) per token, which every
    backend computes as written (it overflows within tens of tokens at g ~ 1). Checked by the public calls on CPU
    tensors only: on a GPU the check would be a host sync on every call (validate_inputs itself reads nothing
    back that a GPU call would not)."""
    if problem.use_gate_in_kernel or g.device.type != "cpu" or g.numel() == 0:
        return
    top = float(g.detach().max())
    if top > 0:
        warnings.warn(f"g has positive values (max {top:.3g}): g is the log of each token's state decay (<= 0), so "
                      f"g > 0 grows the state by exp(g) per token. Pass the raw gate with use_gate_in_kernel=True "
                      f"(and A_log), or a log-decay such as F.logsigmoid(x)", PositiveGateWarning,
                      stacklevel=_caller_stacklevel())


def check_cu_seqlens(cu_seqlens: torch.Tensor, T: int) -> None:
    if cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens must be 1-D [N+1], got shape {_shape(cu_seqlens)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be an int32 or int64 tensor, got {cu_seqlens.dtype}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must hold at least 2 offsets [0, ..., T], got {cu_seqlens.numel()}")
    # Reading the values costs a host sync on a GPU tensor, once per tensor (gdnkit.seqlayout keeps them);
    # skip it while a CUDA graph is being captured, where the caller vouches for the offsets.
    if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    offsets = seqlayout.host_offsets(cu_seqlens)
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0]={offsets[0]}")
    # every call pays this (the offsets are cached, the check is not): sorted() runs at C speed, ~10x a Python
    # loop over thousands of sequences; the loop only finds where, for the message
    if list(offsets) != sorted(offsets):
        for i in range(1, len(offsets)):
            if offsets[i] < offsets[i - 1]:
                raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{i - 1}]={offsets[i - 1]} "
                                 f"> cu_seqlens[{i}]={offsets[i]}")
    if offsets[-1] > T:
        raise ValueError(f"cu_seqlens ends at {offsets[-1]}, past the {T} tokens of q/k/v (T={T})")


POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _check_serving(mode, q, T, N, HV, K, V, state_v_first, pool, cu_seqlens, indices, accepted,
                   inplace_final_state, starts=None, checkpoints=None, every=None, parents=None) -> dict | None:
    """The serving arguments: None for a plain call, else the Problem fields they set.

    `starts` is has_initial_state [N] bool, `checkpoints` / `every` are checkpoint_indices [N, C] and
    checkpoint_every: chunked prefill on the pool only."""
    if indices is None:
        if parents is not None:
            raise ValueError("parent_indices name each draft token's parent among the per-token slots and need 2-D "
                             "ssm_state_indices [N, C]; got ssm_state_indices=None")
        for name, t in (("has_initial_state", starts), ("checkpoint_indices", checkpoints),
                        ("checkpoint_every", every)):
            if t is not None:
                raise ValueError(f"{name} belongs to prefill on a state pool and needs ssm_state_indices [N]; "
                                 f"got ssm_state_indices=None")
        if accepted is not None:
            raise ValueError("num_accepted_tokens picks the read slot among ssm_state_indices[n, :] and needs "
                             "2-D ssm_state_indices [N, C]; got ssm_state_indices=None")
        if inplace_final_state:
            raise ValueError("inplace_final_state=True writes final states into the pool slots named by "
                             "ssm_state_indices; got ssm_state_indices=None")
        return None
    if mode == RECURRENT_MODE and (starts is not None or checkpoints is not None or every is not None):
        raise ValueError("has_initial_state, checkpoint_indices and checkpoint_every are taken by "
                         "chunk_gated_delta_rule (prefill on the pool) only")
    if mode == CHUNK_MODE and (accepted is not None or inplace_final_state is not None):
        raise ValueError("num_accepted_tokens and inplace_final_state are taken by fused_recurrent_gated_delta_rule "
                         "only: chunked prefill on the pool always writes final states back to their slots")
    if inplace_final_state is not None and not isinstance(inplace_final_state, bool):
        raise TypeError(f"inplace_final_state must be a bool or None, got {type(inplace_final_state).__name__}")
    inplace = True if inplace_final_state is None else inplace_final_state

    if pool is None:
        raise ValueError("ssm_state_indices maps sequences to slots of a state pool passed as initial_state "
                         "[num_slots, HV, K, V]; got initial_state=None")
    pool_layout = "[num_slots, HV, V, K] (state_v_first)" if state_v_first else "[num_slots, HV, K, V]"
    _require_rank("initial_state", pool, 4, pool_layout)
    inner = (HV, V, K) if state_v_first else (HV, K, V)
    _require_shape("initial_state", pool, (pool.shape[0], *inner), pool_layout)
    allowed = POOL_DTYPES + ((torch.float64,) if q.dtype == torch.float64 else ())
    if pool.dtype not in allowed:
        raise TypeError(f"initial_state (the state pool) must be float32, bfloat16 or float16"
                        f"{' (or float64 with float64 inputs)' if q.dtype == torch.float64 else ''}, got {pool.dtype}")
    slot_contiguous = pool.stride(3) == 1 and pool.stride(2) == inner[2] and pool.stride(1) == inner[1] * inner[2]
    if pool.shape[0] > 0 and not slot_contiguous:
        raise ValueError(f"initial_state (the state pool) is updated in place and must be contiguous within each "
                         f"slot ({'[HV, V, K]' if state_v_first else '[HV, K, V]'}; any slot stride), got strides "
                         f"{tuple(pool.stride())}")
    num_slots = pool.shape[0]
    slot_size = inner[0] * inner[1] * inner[2]
    if inplace and num_slots > 1 and pool.stride(0) < slot_size:
        # an expanded pool (stride 0) or overlapping slots: distinct slot indices would write one memory
        raise ValueError(f"initial_state (the state pool) is written in place and its slots must not share memory: "
                         f"slot stride {pool.stride(0)} is below a slot's {slot_size} elements (an expanded or "
                         f"overlapping pool, strides {tuple(pool.stride())}); pass a pool with its own memory per slot, "
                         f"e.g. .contiguous(), or inplace_final_state=False to only read it")

    if indices.dtype not in INDEX_DTYPES:
        raise TypeError(f"ssm_state_indices must be an int32 or int64 tensor, got {indices.dtype}")
    if indices.dim() not in (1, 2) or indices.shape[0] != N or (indices.dim() == 2 and indices.shape[1] < 1):
        raise ValueError(f"ssm_state_indices must have shape [N] or [N, C] (C >= 1) with N={N} sequences, "
                         f"got {_shape(indices)}")
    per_token = indices.dim() == 2
    if per_token and mode == CHUNK_MODE:
        raise ValueError("chunk_gated_delta_rule takes 1-D ssm_state_indices [N] (one slot per sequence); "
                         f"per-token slots [N, C] are fused_recurrent_gated_delta_rule's, got {_shape(indices)}")
    if parents is not None:
        _check_per_token_companion("parent_indices", parents, indices, "names each draft token's parent among the "
                                   "per-token slots", tuple(indices.shape), "[N, C] (as ssm_state_indices)")
    if starts is not None:
        if starts.dtype != torch.bool:
            raise TypeError(f"has_initial_state must be a bool tensor, got {starts.dtype}")
        _require_shape("has_initial_state", starts, (N,), "[N]")
    if (checkpoints is None) != (every is None):
        raise ValueError("checkpoint_indices and checkpoint_every go together: got "
                         f"checkpoint_indices={'None' if checkpoints is None else _shape(checkpoints)}, "
                         f"checkpoint_every={every!r}")
    if every is not None:
        if not isinstance(every, int) or isinstance(every, bool) or every <= 0 or every % CHUNK_SIZE:
            raise ValueError(f"checkpoint_every must be a positive multiple of the chunk size {CHUNK_SIZE}, "
                             f"got {every!r}")
        if checkpoints.dtype not in INDEX_DTYPES:
            raise TypeError(f"checkpoint_indices must be an int32 or int64 tensor, got {checkpoints.dtype}")
        if checkpoints.dim() != 2 or checkpoints.shape[0] != N or checkpoints.shape[1] < 1:
            raise ValueError(f"checkpoint_indices must have shape [N, C] (C >= 1) with N={N} sequences, "
                             f"got {_shape(checkpoints)}")
    if per_token and not inplace:
        raise ValueError("2-D ssm_state_indices write the state after every token into its slot; "
                         "inplace_final_state=False is only possible with 1-D ssm_state_indices [N]")
    if accepted is not None:
        _check_per_token_companion("num_accepted_tokens", accepted, indices, "picks the read slot among "
                                   "ssm_state_indices[n, :]", (N,), "[N]")

    # The values cost a host sync on GPU tensors: skipped while a CUDA graph is being captured (the
    # caller vouches for them there), as for cu_seqlens.
    if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        _check_slot_values(indices, accepted, num_slots, inplace, T, N, cu_seqlens, checkpoints, every, parents)
    return dict(serving=True, num_slots=num_slots, per_token_slots=per_token,
                has_num_accepted_tokens=accepted is not None, inplace_final_state=inplace,
                has_start_flags=starts is not None, checkpoint_every=every or 0, has_parents=parents is not None)


def _slots_in_range(name: str, idx: torch.Tensor, num_slots: int) -> None:
    if idx.numel() == 0:
        return
    lo, hi = (int(x) for x in idx.aminmax())   # one pass; where to point in the message only on failure
    if lo < -1 or hi >= num_slots:
        bad = (idx < -1) | (idx >= num_slots)
        at = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"{name} must hold pool slots in [0, {num_slots}) or -1 for padding, got "
                         f"{int(idx[at])} at {list(at)}")


def _check_per_token_companion(name: str, t: torch.Tensor, indices: torch.Tensor, purpose: str, shape, layout):
    """An index tensor that only means something with 2-D (per-token) ssm_state_indices."""
    if indices.dim() != 2:
        raise ValueError(f"{name} {purpose} and needs 2-D ssm_state_indices [N, C], got shape {_shape(indices)}")
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {t.dtype}")
    _require_shape(name, t, shape, layout)


def _check_slot_values(indices, accepted, num_slots, inplace, T, N, cu_seqlens, checkpoints=None,
                       every=None, parents=None) -> None:
    if indices.dim() == 1 and checkpoints is None and _one_slot_each_holds(indices.tolist(), num_slots, inplace):
        # one slot per sequence, read and (in place) written by it alone: slots in range, and in place no live slot
        # twice, is all there is to check (a decode step's or a pool prefill's common case: one copy to the host
        # and a pass in Python; the general checks below say where it fails)
        return
    idx = indices.detach().cpu().long()
    _slots_in_range("ssm_state_indices", idx, num_slots)
    lengths = (torch.full((N,), T, dtype=torch.long) if cu_seqlens is None
               else cu_seqlens.detach().cpu().long().diff())
    if idx.dim() == 1:
        read = idx
    else:
        C = idx.shape[1]
        col = torch.zeros(N, dtype=torch.long)
        if accepted is not None:
            col = accepted.detach().cpu().long() - 1
            bad = (col < 0) | (col >= C)
            if bad.any():
                n = int(bad.nonzero()[0, 0])
                raise ValueError(f"num_accepted_tokens must be in [1, {C}] (the columns of ssm_state_indices), "
                                 f"got {int(col[n]) + 1} for sequence {n}")
        read = idx.gather(1, col[:, None])[:, 0]
        too_long = (lengths > C) & (read >= 0)
        if too_long.any():
            n = int(too_long.nonzero()[0, 0])
            raise ValueError(f"2-D ssm_state_indices need a slot column per token: sequence {n} has "
                             f"{int(lengths[n])} tokens, ssm_state_indices has C={C} columns")
        if parents is not None:
            _check_parents(parents.detach().cpu().long(), idx, (read >= 0)[:, None] & (
                torch.arange(C)[None, :] < lengths[:, None]))
    if not inplace:
        return
    # Two sequences writing one slot, or one writing a slot another reads, would race in the kernel.
    live = read >= 0
    if idx.dim() == 1:
        writes, owners = read[live], live.nonzero()[:, 0]
    else:
        t = torch.arange(idx.shape[1])
        used = live[:, None] & (t[None, :] < lengths[:, None]) & (idx >= 0)
        writes, owners = idx[used], used.nonzero()[:, 0]
    if checkpoints is not None:
        ck = checkpoints.detach().cpu().long()
        _slots_in_range("checkpoint_indices", ck, num_slots)
        # checkpoint j of sequence n is written once (j + 1) * every <= its length
        j = torch.arange(ck.shape[1])
        used = live[:, None] & ((j[None, :] + 1) * every <= lengths[:, None]) & (ck >= 0)
        writes, owners = torch.cat([writes, ck[used]]), torch.cat([owners, used.nonzero()[:, 0]])
    owner_of = torch.full((num_slots,), -1, dtype=torch.long)
    owner_of[writes] = owners
    clash = owner_of[writes] != owners
    if clash.any():
        i = int(clash.nonzero()[0, 0])
        raise ValueError(f"ssm_state_indices: pool slot {int(writes[i])} is written by sequences {int(owners[i])} "
                         f"and {int(owner_of[writes[i]])}; each slot may belong to one sequence per call")
    if checkpoints is not None:  # (1-D indices: one sequence's writes are distinct slots too)
        twice = torch.bincount(writes, minlength=num_slots)[writes] > 1
        if twice.any():
            i = int(twice.nonzero()[0, 0])
            raise ValueError(f"checkpoint_indices: pool slot {int(writes[i])} is written twice by sequence "
                             f"{int(owners[i])} (its state slot and a checkpoint, or two checkpoints)")
    readers = live.nonzero()[:, 0]
    writer = owner_of[read[readers]]
    clash = (writer >= 0) & (writer != readers)
    if clash.any():
        i = int(clash.nonzero()[0, 0])
        raise ValueError(f"ssm_state_indices: sequence {int(readers[i])} reads pool slot {int(read[readers[i]])}, "
                         f"which sequence {int(writer[i])} writes in the same call")


def _one_slot_each_holds(slots: list[int], num_slots: int, inplace: bool) -> bool:
    """1-D indices as a list: every slot in [-1, num_slots), and in place no live slot named twice."""
    if slots and (min(slots) < -1 or max(slots) >= num_slots):
        return False
    live = [s for s in slots if s >= 0]
    return not inplace or len(set(live)) == len(live)


def _check_parents(parents: torch.Tensor, idx: torch.Tensor, used: torch.Tensor) -> None:
    """Token t of a live sequence continues from an earlier token (or -1, the accepted state); a parent other
    than t - 1 is read back from its slot, which must therefore have been written."""
    t = torch.arange(parents.shape[1])[None, :]
    bad = used & ((parents < -1) | (parents >= t))
    if bad.any():
        n, col = bad.nonzero()[0].tolist()
        raise ValueError(f"parent_indices[{n}, {col}] must be -1 (the accepted state) or an earlier token in "
                         f"[0, {col}), got {int(parents[n, col])}")
    slot_of_parent = idx.gather(1, parents.clamp_min(0))
    bad = used & (parents >= 0) & (parents != t - 1) & (slot_of_parent < 0)
    if bad.any():
        n, col = bad.nonzero()[0].tolist()
        raise ValueError(f"parent_indices[{n}, {col}] = {int(parents[n, col])} continues from a token whose state "
                         f"is not kept (ssm_state_indices[{n}, {int(parents[n, col])}] = -1)")


def validate_inputs(mode: str, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                    use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                    cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                    inplace_final_state=None, has_initial_state=None, checkpoint_indices=None,
                    checkpoint_every=None, parent_indices=None) -> tuple[Problem, GDNInputs | GDNServingInputs]:
    """Check a call's arguments and describe it. Raises ValueError/TypeError naming the argument."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _require_tensor(name, t)
    _require_rank("q", q, 4, "[B, T, H, K]")
    _require_rank("k", k, 4, "[B, T, H, K]")
    _require_rank("v", v, 4, "[B, T, HV, V]")
    B, T, H, K = q.shape
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k must have the same shape as q [B, T, H, K] = {_shape(q)}, got {_shape(k)}")
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(_head_first_hint(q, v) or
                         f"v must have shape [B, T, HV, V] with B={B}, T={T} as q, got {_shape(v)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H != 0:
        raise ValueError(f"the number of value heads must be a multiple of the q/k heads: v has HV={HV}, "
                         f"q/k have H={H} (HV % H = {HV % H if H else 'undefined'})")
    if min(K, V) == 0:
        raise ValueError(f"head dims must be positive, got K={K}, V={V}")

    if q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"q must be a floating tensor (float16/bfloat16/float32/float64), got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"q, k and v must share one floating dtype: q is {q.dtype}, {name} is {t.dtype}")

    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (B, T, HV) and (hint := _head_first_hint(q, v, g, beta)):
            raise ValueError(hint)
        _require_shape(name, t, (B, T, HV), "[B, T, HV]")
    for name, t in (("g", g), ("beta", beta)):
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")

    device = q.device
    named = [("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
             ("A_log", A_log), ("dt_bias", dt_bias), ("cu_seqlens", cu_seqlens),
             ("ssm_state_indices", ssm_state_indices), ("num_accepted_tokens", num_accepted_tokens),
             ("has_initial_state", has_initial_state), ("checkpoint_indices", checkpoint_indices),
             ("parent_indices", parent_indices)]
    for name, t in named:
        if t is not None:
            _require_tensor(name, t)
            if t.device != device:
                raise ValueError(f"all tensors must be on one device: q is on {device}, {name} is on {t.device}")

    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens, sequences are packed along T and the batch size must be 1, "
                             f"got B={B} (q shape {_shape(q)})")
        check_cu_seqlens(cu_seqlens, T)
        N = cu_seqlens.numel() - 1
    else:
        N = B

    state_shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    state_layout = "[N, HV, V, K] (state_v_first)" if state_v_first else "[N, HV, K, V]"
    serving = _check_serving(mode, q, T, N, HV, K, V, state_v_first, initial_state, cu_seqlens,
                             ssm_state_indices, num_accepted_tokens, inplace_final_state, has_initial_state,
                             checkpoint_indices, checkpoint_every, parent_indices)
    if serving is None and initial_state is not None:  # (a serving pool was checked by _check_serving)
        _require_rank("initial_state", initial_state, 4, state_layout)
        if initial_state.shape[0] != N:
            raise ValueError(f"initial_state must hold one state per sequence: N={N} "
                             f"({'len(cu_seqlens) - 1' if cu_seqlens is not None else 'the batch size'}), "
                             f"got {initial_state.shape[0]} (shape {_shape(initial_state)})")
        _require_shape("initial_state", initial_state, state_shape, state_layout)
        if initial_state.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            raise TypeError(f"initial_state must be a floating tensor (float32; bfloat16 / float16 are taken as "
                            f"float32, as FLA takes them), got {initial_state.dtype}")
        if initial_state.dtype in (torch.bfloat16, torch.float16):
            # states are float32 throughout (FLA's callers, e.g. a model's bf16 cache, pass half ones); the cast
            # is a torch op, so the gradient reaches the caller's tensor in its own dtype
            initial_state = initial_state.float()

    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("use_gate_in_kernel=True needs A_log of shape [HV] "
                             "(g = -exp(A_log) * softplus(g + dt_bias)), got A_log=None")
        _require_shape("A_log", A_log, (HV,), "[HV]")
        if dt_bias is not None:
            _require_shape("dt_bias", dt_bias, (HV,), "[HV]")
        for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
            if t is not None and t.dtype not in FLOAT_DTYPES:
                raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log/dt_bias are only used with use_gate_in_kernel=True; pass that flag or drop them")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True scales the in-kernel sigmoid of beta to [0, 2) and needs "
                         "use_beta_sigmoid_in_kernel=True")

    if scale is None:
        scale = K ** -0.5
    elif not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")

    tensors = [q, k, v, g, beta, initial_state, A_log, dt_bias]
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if serving is not None and needs_grad:
        raise ValueError("the serving interface (ssm_state_indices) updates states in place and is inference-only: "
                         "call it under torch.no_grad()/torch.inference_mode() or with tensors not requiring grad")
    problem = Problem(
        mode=mode, B=B, T=T, H=H, HV=HV, K=K, V=V, N=N, dtype=q.dtype, gate_dtype=g.dtype,
        device_type=device.type, device_index=device.index, scale=float(scale),
        varlen=cu_seqlens is not None, has_initial_state=initial_state is not None,
        state_dtype=None if initial_state is None else initial_state.dtype,
        output_final_state=bool(output_final_state), use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
        use_gate_in_kernel=bool(use_gate_in_kernel), has_dt_bias=dt_bias is not None,
        use_beta_sigmoid_in_kernel=bool(use_beta_sigmoid_in_kernel), allow_neg_eigval=bool(allow_neg_eigval),
        state_v_first=bool(state_v_first), needs_grad=needs_grad, **(serving or {}))
    if serving is not None:
        return problem, GDNServingInputs(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens,
                                         ssm_state_indices, num_accepted_tokens, has_initial_state,
                                         checkpoint_indices, parent_indices)
    inputs = GDNInputs(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens)
    return problem, inputs
