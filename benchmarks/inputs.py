"""Inputs exactly as FlashQLA's published anchor numbers were measured.

bf16 q/k/v with K = V = 128; q and k L2-normalised before the call (not in the kernel); g =
logsigmoid(randn) and beta = sigmoid(rand), both fp32; sequences packed along T with cu_seqlens
(B = 1). GDNKIT_BENCH_GATES=model (`bench --gates model`) draws g as a Qwen3-Next-style layer does at
initialisation instead: per value head A ~ U(0, 16) and dt ~ logU(1e-3, 0.1) (dt_bias its inverse
softplus), g = -A softplus(a + dt_bias) with a ~ N(0, 1) per token. Its slowest heads decay ~1e-3 a token
where logsigmoid(randn) decays ~0.8, which decides how context parallelism can start its segments.
GDNKIT_BENCH_QK_L2NORM=1 (`bench --qk-l2norm`) draws q and k raw and has every implementation normalise them
in the call (use_qk_l2norm_in_kernel, as Qwen3.5-style layers call it). Decode: B sequences of one new token
each, a random fp32 state, output_final_state=True; GDNKIT_BENCH_STATE_DTYPE=bfloat16 (`bench --state-dtype
bfloat16`) draws the decode states in bf16 instead, which every implementation updates in a state pool in place,
as serving engines keep them.
Every tensor is random (never zeros: zeros hide unwritten outputs and can run faster than real data)
and drawn from a generator seeded by the grid point, so every implementation sees the same inputs.
"""
from __future__ import annotations

import dataclasses
import math
import os
import zlib

import torch
import torch.nn.functional as F

from .grids import STATE_PASSES, Point

DTYPE = torch.bfloat16
GATE_DTYPE = torch.float32
STATE_DTYPE = torch.float32
GATES_ENV = "GDNKIT_BENCH_GATES"
GATES = ("random", "model")
QK_L2NORM_ENV = "GDNKIT_BENCH_QK_L2NORM"
STATE_DTYPE_ENV = "GDNKIT_BENCH_STATE_DTYPE"
DECODE_STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def gates_kind() -> str:
    """The gate distribution of this process's inputs (read from the environment, so worker processes
    spawned for compiling draw the same inputs as the timing process)."""
    kind = os.environ.get(GATES_ENV, "random")
    if kind not in GATES:
        raise ValueError(f"{GATES_ENV}={kind!r}: choose from {', '.join(GATES)}")
    return kind


def qk_l2norm_on() -> bool:
    """Whether this process's calls normalise q and k themselves (QK_L2NORM_ENV, read as gates_kind is)."""
    value = os.environ.get(QK_L2NORM_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{QK_L2NORM_ENV}={value!r}: 0 or 1")
    return value == "1"


def decode_state_dtype() -> torch.dtype:
    """The dtype of this process's decode states (STATE_DTYPE_ENV, read as gates_kind is)."""
    value = os.environ.get(STATE_DTYPE_ENV, "float32")
    if value not in DECODE_STATE_DTYPES:
        raise ValueError(f"{STATE_DTYPE_ENV}={value!r}: choose from {', '.join(DECODE_STATE_DTYPES)}")
    return DECODE_STATE_DTYPES[value]


def state_dtype_name(point: Point) -> str:
    """What a row of `point` records as its state dtype: the decode and mtp states', fp32 elsewhere."""
    dtype = decode_state_dtype() if point.pass_ in STATE_PASSES else STATE_DTYPE
    return next(name for name, d in DECODE_STATE_DTYPES.items() if d == dtype)


def call_options() -> dict:
    """The keyword options every implementation's chunk and decode calls take in this process."""
    return {"use_qk_l2norm_in_kernel": True} if qk_l2norm_on() else {}


def _qk(randn, shape) -> torch.Tensor:
    """q or k in DTYPE: L2-normalised before the call, or raw where the call normalises them."""
    x = randn(*shape)
    return (x if qk_l2norm_on() else F.normalize(x, p=2, dim=-1)).to(DTYPE)


def _gates(shape: tuple, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """g [..., HV] in fp32, per gates_kind()."""
    if gates_kind() == "random":
        return F.logsigmoid(torch.randn(*shape, generator=gen, device=device))
    HV = shape[-1]
    A = torch.rand(HV, generator=gen, device=device) * 16
    dt = torch.exp(torch.rand(HV, generator=gen, device=device) * math.log(100.0) + math.log(1e-3))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    a = torch.randn(*shape, generator=gen, device=device)
    return -A * F.softplus(a + dt_bias)


@dataclasses.dataclass
class ChunkInputs:
    q: torch.Tensor  # [1, T, H, K]
    k: torch.Tensor
    v: torch.Tensor  # [1, T, HV, V]
    g: torch.Tensor  # [1, T, HV]
    beta: torch.Tensor
    cu_seqlens: torch.Tensor | None  # [N+1] int64
    initial_state: torch.Tensor | None = None  # [N, HV, K, V] fp32
    do: torch.Tensor | None = None  # dO for backward, like v

    def leaves(self) -> list[torch.Tensor]:
        """Tensors gradients are taken for (the backward pass)."""
        return [self.q, self.k, self.v, self.g, self.beta]

    def nbytes(self) -> int:
        ts = [self.q, self.k, self.v, self.g, self.beta, self.initial_state, self.do]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def seed_for(point: Point, salt: str = "") -> int:
    """A stable seed per grid point (same inputs for every implementation, run to run)."""
    return zlib.crc32(repr((point.key, point.K, point.V, salt)).encode()) & 0x7FFFFFFF


def _generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def cu_seqlens_of(seqlens, device) -> torch.Tensor:
    offsets = [0]
    for n in seqlens:
        offsets.append(offsets[-1] + int(n))
    return torch.tensor(offsets, dtype=torch.long, device=device)


def make_chunk_inputs(H: int, HV: int, seqlens, K: int, V: int, device, seed: int, *,
                      with_do: bool = False, initial_state: bool = False,
                      cu_seqlens: torch.Tensor | None = None) -> ChunkInputs:
    """One packed problem. Pass `cu_seqlens` to share one offsets tensor between input sets: the
    anchors cache index tables per offsets tensor, and a new tensor per call would defeat graph capture."""
    device = torch.device(device)
    gen = _generator(device, seed)
    T = int(sum(seqlens))
    N = len(seqlens)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    q = _qk(randn, (1, T, H, K))
    k = _qk(randn, (1, T, H, K))
    v = randn(1, T, HV, V).to(DTYPE)
    g = _gates((1, T, HV), gen, device).to(GATE_DTYPE)
    beta = torch.sigmoid(torch.rand(1, T, HV, generator=gen, device=device)).to(GATE_DTYPE)
    h0 = randn(N, HV, K, V).to(STATE_DTYPE) if initial_state else None
    do = randn(1, T, HV, V).to(DTYPE) if with_do else None
    if cu_seqlens is None:
        cu_seqlens = cu_seqlens_of(seqlens, device)
    return ChunkInputs(q, k, v, g, beta, cu_seqlens, h0, do)


def make_decode_inputs(B: int, H: int, HV: int, K: int, V: int, device, seed: int, T: int = 1) -> ChunkInputs:
    """B sequences of T new tokens each (decode: 1; mtp: the draft tokens), dense batch (no cu_seqlens), a random
    state in decode_state_dtype()."""
    device = torch.device(device)
    gen = _generator(device, seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    q = _qk(randn, (B, T, H, K))
    k = _qk(randn, (B, T, H, K))
    v = randn(B, T, HV, V).to(DTYPE)
    g = _gates((B, T, HV), gen, device).to(GATE_DTYPE)
    beta = torch.sigmoid(torch.rand(B, T, HV, generator=gen, device=device)).to(GATE_DTYPE)
    h0 = randn(B, HV, K, V).to(decode_state_dtype())
    return ChunkInputs(q, k, v, g, beta, None, h0, None)


def make_point_inputs(point: Point, device, set_index: int = 0,
                      cu_seqlens: torch.Tensor | None = None) -> ChunkInputs:
    """The inputs of a grid point; `set_index` draws another independent set of the same shape."""
    seed = seed_for(point, f"set{set_index}")
    if point.pass_ in STATE_PASSES:
        return make_decode_inputs(point.B, point.H, point.HV, point.K, point.V, device, seed, T=point.seqlens[0])
    return make_chunk_inputs(point.H, point.HV, point.seqlens, point.K, point.V, device, seed,
                             with_do=point.pass_ == "bwd", cu_seqlens=cu_seqlens)


def state_bytes(point: Point) -> int:
    """Bytes of the B states a decode or mtp call starts from, in decode_state_dtype()."""
    return (point.B or 1) * point.HV * point.K * point.V * torch.finfo(decode_state_dtype()).bits // 8


def state_traffic_bytes(point: Point) -> int:
    """State bytes a call moves: decode reads each state and writes it back; mtp reads it and writes every draft
    token's state (what a verify keeps for the accept step)."""
    return state_bytes(point) * (1 + (point.seqlens[0] if point.pass_ == "mtp" else 1))


def requires_grad_(inp: ChunkInputs) -> ChunkInputs:
    for t in inp.leaves():
        t.requires_grad_(True)
    return inp
