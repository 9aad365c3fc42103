"""Adapters: one object per implementation the harness compares, all called the same way.

  gdnkit:<backend>  gdnkit's public call with backend=<backend> forced
  fla               FLA 0.6.0's Triton path (fla.ops.gated_delta_rule), FLA_FLASH_QLA=0
  flashqla          FlashQLA 0.1.3 (flash_qla), prefill only
  flashinfer        FlashInfer 0.7.2 (flashinfer.gdn_prefill / gdn_decode, CuTe-DSL kernels on sm90): prefill,
                    decode and verify, no backward

The anchors (fla, flash_qla, flashinfer) are imported here, lazily, and nowhere in gdnkit's own code. Nothing
of theirs is copied: the adapters only call their public functions, with FLA's tensor layouts where they take
them and converted once per input set (outside the timed call) where they do not.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import sys
import weakref
from typing import Any

import torch

from .grids import STATE_PASSES, Point
from .inputs import ChunkInputs, call_options, decode_state_dtype, qk_l2norm_on

# The anchors, in the order results list them (report.py's tables compare every other implementation with FLA,
# and gdnkit's with each of the others), and how results name them.
ANCHORS = ("fla", "flashqla", "flashinfer")
ANCHOR_TITLES = {"fla": "FLA", "flashqla": "FlashQLA", "flashinfer": "FlashInfer"}


class Unsupported(Exception):
    """The implementation cannot take this problem (not a failure: nothing was measured)."""


class Impl:
    name: str = "?"
    is_anchor: bool = False
    # Versions that must match for a row of an earlier run to stand in for this one (--anchors cached).
    version_keys: tuple[str, ...] = ("torch",)

    def _once(self, inp: ChunkInputs, convert) -> Any:
        """convert(inp), made at this implementation's first call of inp and dropped with inp: what it needs
        beside an input set (another layout, its own state pool) is made outside the timed calls."""
        cache = self.__dict__.setdefault("_converted", {})
        key = id(inp)
        hit = cache.get(key)
        if hit is None or hit[0]() is not inp:
            ref = weakref.ref(inp, lambda _, key=key: cache.pop(key, None))
            hit = cache[key] = (ref, convert(inp))
        return hit[1]

    def unavailable(self, device: torch.device) -> str | None:
        """Why this implementation cannot run here at all; None when it can."""
        return None

    def skip_reason(self, point: Point) -> str | None:
        """Why this implementation has nothing to run for this kind of point; None when it does."""
        return None

    def chunk(self, inp: ChunkInputs, output_final_state: bool = False) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def decode(self, inp: ChunkInputs) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def mtp(self, inp: ChunkInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """A verify of inp's T draft tokens a sequence from its state: (o [B, T, HV, V], every token's state
        [B, T, HV, K, V])."""
        raise Unsupported(f"{self.name} has no verify (draft tokens with their states kept) entry point")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class GdnkitImpl(Impl):
    version_keys = ("gdnkit", "torch", "triton", "tilelang")

    def __init__(self, backend: str):
        self.backend = backend
        self.name = f"gdnkit:{backend}"

    def unavailable(self, device):
        import gdnkit
        names = gdnkit.available_backends()
        if self.backend not in names:
            return f"gdnkit backend {self.backend!r} cannot run on this machine (available: {', '.join(names)})"
        return None

    def _wrap(self, fn, *args, **kwargs):
        import gdnkit
        try:
            return fn(*args, backend=self.backend, **kwargs)
        except gdnkit.BackendNotSupportedError as exc:
            raise Unsupported(str(exc).replace("\n", " ")) from exc

    def chunk(self, inp, output_final_state=False):
        import gdnkit
        return self._wrap(gdnkit.chunk_gated_delta_rule, inp.q, inp.k, inp.v, inp.g, inp.beta,
                          initial_state=inp.initial_state, output_final_state=output_final_state,
                          cu_seqlens=inp.cu_seqlens, **call_options())

    @staticmethod
    def k_last(h0: torch.Tensor) -> bool:
        """Whether this implementation's pool keeps each state [V, K] (state_v_first): for 16-bit states, the layout
        FlashInfer's decode and verify take, so both move the same bytes in the same order (an H100 sweep,
        benchmarks/results/h100/decode-tiles.md: 94.4 us [V, K] against 100.1 [K, V] at 16/64 B=64). fp32 states
        stay [K, V], FLA's layout."""
        return h0.dtype != torch.float32

    def decode(self, inp):
        import gdnkit
        h0 = inp.initial_state
        if not self.k_last(h0):
            return self._wrap(gdnkit.fused_recurrent_gated_delta_rule, inp.q, inp.k, inp.v, inp.g, inp.beta,
                              initial_state=h0, output_final_state=True, cu_seqlens=inp.cu_seqlens, **call_options())
        # a 16-bit state: this implementation's own pool of the batch's states, [V, K] each, updated in place
        pool, slots = self._once(inp, lambda i: (i.initial_state.transpose(-1, -2).contiguous(), torch.arange(
            i.initial_state.shape[0], device=i.initial_state.device, dtype=torch.int32)))
        o, _ = self._wrap(gdnkit.fused_recurrent_gated_delta_rule, inp.q, inp.k, inp.v, inp.g, inp.beta,
                          initial_state=pool, ssm_state_indices=slots, state_v_first=True, **call_options())
        return o, pool.transpose(-1, -2)

    @classmethod
    def verify_pool(cls, inp: ChunkInputs):
        """(pool of B*T slots, [B, T] slots, accepted = 1): sequence n reads slot n*T (its state) and writes token
        t's state to slot n*T + t, so a call moves what a verify moves; token 0's state replaces the state read
        (the serving call's in-place pool), which later calls then start from. Each slot [V, K] where k_last."""
        B, T = inp.q.shape[:2]
        h0 = inp.initial_state
        if cls.k_last(h0):
            h0 = h0.transpose(-1, -2)
        pool = torch.empty(B * T, *h0.shape[1:], device=h0.device, dtype=h0.dtype)
        pool[::T] = h0
        slots = torch.arange(B * T, device=h0.device, dtype=torch.int32).view(B, T)
        return pool, slots, torch.ones(B, device=h0.device, dtype=torch.int32)

    def mtp(self, inp):
        import gdnkit
        pool, slots, accepted = self._once(inp, self.verify_pool)
        k_last = self.k_last(inp.initial_state)
        o, _ = self._wrap(gdnkit.fused_recurrent_gated_delta_rule, inp.q, inp.k, inp.v, inp.g, inp.beta,
                          initial_state=pool, ssm_state_indices=slots, num_accepted_tokens=accepted,
                          state_v_first=k_last, **call_options())
        states = pool.view(*slots.shape, *pool.shape[1:])
        return o, states.transpose(-1, -2) if k_last else states


class AnchorImpl(Impl):
    """An anchor library called through its FLA-compatible chunk_gated_delta_rule."""

    is_anchor = True
    module_name: str
    needs_gpu: str  # why it cannot run off a CUDA GPU

    def _module(self):
        return importlib.import_module(self.module_name)

    def unavailable(self, device):
        if torch.device(device).type != "cuda":
            return self.needs_gpu
        try:
            self._module()  # flash_qla raises here on an unsupported GPU generation
        except Exception as exc:
            return f"{self.module_name} is not importable ({type(exc).__name__}: {exc})"
        return None

    def chunk(self, inp, output_final_state=False):
        m = self._module()
        return m.chunk_gated_delta_rule(inp.q, inp.k, inp.v, inp.g, inp.beta, initial_state=inp.initial_state,
                                        output_final_state=output_final_state, cu_seqlens=inp.cu_seqlens,
                                        **call_options())


class FlaImpl(AnchorImpl):
    name = "fla"
    module_name = "fla.ops.gated_delta_rule"
    needs_gpu = "fla's Triton kernels need a CUDA GPU"
    version_keys = ("fla", "torch", "triton")

    def _module(self):
        # `import fla` hands chunk_gated_delta_rule to FlashQLA whenever flash_qla is importable;
        # the anchor is FLA's own Triton path, so the switch is set before the first import.
        os.environ["FLA_FLASH_QLA"] = "0"
        return super()._module()

    NO_POOL = "FLA 0.6's decode takes no state pool (it writes a new fp32 final state), so no 16-bit state in place"

    NO_VERIFY = "FLA 0.6's fused recurrent keeps no per-token states (a verify's accept step needs them)"

    def skip_reason(self, point):
        if point.pass_ == "mtp":
            return self.NO_VERIFY
        if point.pass_ == "decode" and decode_state_dtype() != torch.float32:
            return self.NO_POOL
        return None

    def decode(self, inp):
        m = self._module()
        return m.fused_recurrent_gated_delta_rule(inp.q, inp.k, inp.v, g=inp.g, beta=inp.beta,
                                                  initial_state=inp.initial_state, output_final_state=True,
                                                  cu_seqlens=inp.cu_seqlens, **call_options())


class FlashQLAImpl(AnchorImpl):
    name = "flashqla"
    module_name = "flash_qla"
    needs_gpu = "flash_qla's TileLang kernels need a CUDA GPU (sm90/sm100/sm120)"
    version_keys = ("flash_qla", "tilelang", "torch")
    NO_DECODE = "flash_qla 0.1.3 has no decode (fused recurrent) entry point"

    def skip_reason(self, point):
        return self.NO_DECODE if point.pass_ in STATE_PASSES else None

    def decode(self, inp):
        raise Unsupported(self.NO_DECODE)


class FlashInferImpl(AnchorImpl):
    """FlashInfer's GDN prefill, decode and verify. Its conventions are not FLA's; the adapter converts each input set
    once, on its first call, and keeps the result beside it (never inside a timed call):
      - prefill: q/k/v packed [T, H, D] (the harness's B = 1 view), g as the decay factor exp(g) in fp32 [T, HV],
        beta as given; states V-major [N, HV, V, K], handed back as a transposed view;
      - decode: the gate's raw inputs, g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b): with
        A_log = dt_bias = 0, a = log(expm1(-g)) and b = logit(beta), in bf16 as its API takes them (so its gates
        are the others' within bf16 rounding). Its decode updates a pool (of the states' dtype: fp32 takes its
        legacy kernel, bf16 its fast path) in place: the adapter's pool holds the input states in slots [0, B) and
        the call writes slots [B, 2B), so every call reads the same states and moves the same bytes as the
        others; the output buffer is allocated once, as an engine's is;
      - verify (mtp): the same call with T draft tokens, every token's state into the caller's buffer and the pool
        left as it was (disable_state_update)."""

    name = "flashinfer"
    module_name = "flashinfer.gdn_prefill"
    needs_gpu = "flashinfer's GDN kernels need a CUDA GPU (sm90+)"
    version_keys = ("flashinfer", "torch")
    NO_BACKWARD = "flashinfer 0.7.2's GDN prefill has no backward"
    HEAD_DIMS = "flashinfer's GDN kernels take K = V = 128 only"

    def unavailable(self, device):
        if torch.device(device).type != "cuda":
            return self.needs_gpu
        try:
            importlib.import_module("cutlass.cute")
        except Exception as exc:
            return ("flashinfer's sm90 GDN kernels are CuTe-DSL programs and need nvidia-cutlass-dsl "
                    f"(import cutlass.cute: {type(exc).__name__}: {exc})")
        return super().unavailable(device)

    def skip_reason(self, point):
        if point.pass_ == "bwd":
            return self.NO_BACKWARD
        if (point.K, point.V) != (128, 128):
            return self.HEAD_DIMS
        return None

    @staticmethod
    def prefill_inputs(inp: ChunkInputs) -> dict:
        h0 = inp.initial_state
        return dict(q=inp.q[0], k=inp.k[0], v=inp.v[0], g=inp.g[0].float().exp(), beta=inp.beta[0].float(),
                    initial_state=None if h0 is None else h0.transpose(-1, -2).contiguous(),
                    cu_seqlens=inp.cu_seqlens)

    @staticmethod
    def _gate_inputs(inp: ChunkInputs) -> dict:
        """Its decode kernels' raw gate inputs for inp's g and beta (the class doc)."""
        HV = inp.v.shape[2]
        zeros = torch.zeros(HV, device=inp.v.device, dtype=torch.float32)
        return dict(A_log=zeros, dt_bias=zeros, a=torch.log(torch.expm1(-inp.g.float())).to(torch.bfloat16),
                    b=torch.logit(inp.beta.float()).to(torch.bfloat16))

    @classmethod
    def decode_inputs(cls, inp: ChunkInputs) -> dict:
        B, _, HV, V = inp.v.shape
        K = inp.k.shape[-1]
        pool = torch.empty(2 * B, HV, V, K, device=inp.v.device, dtype=inp.initial_state.dtype)
        pool[:B] = inp.initial_state.transpose(-1, -2)
        # two tensors, not two halves of one: its kernels take 16-byte aligned index arrays, which slots[B:] of
        # one int32 arange is not for B = 1, 2, 3, 5, ...
        read, write = (torch.arange(a, a + B, device=inp.v.device, dtype=torch.int32) for a in (0, B))
        return dict(q=inp.q, k=inp.k, v=inp.v, state=None, **cls._gate_inputs(inp),
                    initial_state=pool, initial_state_indices=read, output_state_indices=write,
                    output=torch.empty(B, 1, HV, V, device=inp.v.device, dtype=torch.bfloat16))

    @classmethod
    def verify_inputs(cls, inp: ChunkInputs) -> dict:
        """Its verify: the pool holds the B states, every token's state goes to the caller's buffer
        (intermediate_states_buffer [B, T, HV, V, K]) and the pool is left as it was (disable_state_update)."""
        B, T, HV, V = inp.v.shape
        K = inp.k.shape[-1]
        h0 = inp.initial_state
        return dict(q=inp.q, k=inp.k, v=inp.v, state=None, **cls._gate_inputs(inp),
                    initial_state=h0.transpose(-1, -2).contiguous(),
                    initial_state_indices=torch.arange(B, device=h0.device, dtype=torch.int32),
                    intermediate_states_buffer=torch.empty(B, T, HV, V, K, device=h0.device, dtype=h0.dtype),
                    disable_state_update=True,
                    output=torch.empty(B, T, HV, V, device=inp.v.device, dtype=torch.bfloat16))

    def chunk(self, inp, output_final_state=False):
        m = self._module()
        out = m.chunk_gated_delta_rule(**self._once(inp, self.prefill_inputs),
                                       output_final_state=output_final_state, **call_options())
        if output_final_state:
            o, state = out
            return o.unsqueeze(0), state.transpose(-1, -2)
        return out.unsqueeze(0), None

    def decode(self, inp):
        m = importlib.import_module("flashinfer.gdn_decode")
        args = self._once(inp, self.decode_inputs)
        o, pool = m.gated_delta_rule_decode_pretranspose(**args, use_qk_l2norm=qk_l2norm_on(),
                                                         backend="flashinfer")
        B = o.shape[0]
        return o, pool[B:].transpose(-1, -2)

    def mtp(self, inp):
        m = importlib.import_module("flashinfer.gdn_decode")
        args = self._once(inp, self.verify_inputs)
        o, _ = m.gated_delta_rule_decode_pretranspose(**args, use_qk_l2norm=qk_l2norm_on(), backend="flashinfer")
        return o, args["intermediate_states_buffer"].transpose(-1, -2)


def gdnkit_backends() -> list[str]:
    import gdnkit
    return list(gdnkit.available_backends())


def resolve(spec: str | None, device) -> list[Impl]:
    """Implementations named by --impls: "all" (default), or a comma list of "gdnkit" (every
    available gdnkit backend), "gdnkit:<backend>", "fla", "flashqla", "flashinfer". Anchors come first, in
    ANCHORS' order (FLA first), so every other output is compared with FLA's on the same inputs."""
    device = torch.device(device)
    tokens = [t.strip() for t in (spec or "all").split(",") if t.strip()]
    names: list[str] = []

    def add(name):
        if name not in names:
            names.append(name)

    for tok in tokens:
        if tok == "all":
            for anchor in ANCHORS:
                add(anchor)
            tok = "gdnkit"
        if tok == "gdnkit":
            for b in gdnkit_backends():
                # The PyTorch reference is the oracle, not a contender: on a GPU its per-token
                # Python loop would take minutes per point. Name gdnkit:reference to time it anyway.
                if b == "reference" and device.type == "cuda":
                    continue
                add(f"gdnkit:{b}")
        elif tok.startswith("gdnkit:"):
            add(tok)
        elif tok in ANCHORS:
            add(tok)
        else:
            raise ValueError(f"unknown implementation {tok!r}; use all, gdnkit, gdnkit:<backend>, "
                             f"{', '.join(ANCHORS)}")
    names.sort(key=lambda n: ANCHORS.index(n) if n in ANCHORS else len(ANCHORS))
    anchors = {"fla": FlaImpl, "flashqla": FlashQLAImpl, "flashinfer": FlashInferImpl}
    return [anchors[n]() if n in anchors else GdnkitImpl(n.split(":", 1)[1]) for n in names]


_DISTS = {
    "torch": ("torch",), "triton": ("triton",), "tilelang": ("tilelang",),
    "fla": ("flash-linear-attention", "fla-core"), "flash_qla": ("flash_qla", "flash-qla"),
    "flashinfer": ("flashinfer-python", "flashinfer"),
}


def _dist_version(names) -> str | None:
    for n in names:
        try:
            return importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def environment_versions() -> dict[str, str | None]:
    """Versions recorded with every row. Read from package metadata, so nothing is imported
    (flash_qla raises at import on a machine without a supported GPU)."""
    import gdnkit
    versions: dict[str, str | None] = {"gdnkit": gdnkit.__version__}
    for key, dists in _DISTS.items():
        versions[key] = _dist_version(dists)
    versions["torch"] = torch.__version__  # the running build (+cu130 / +cpu), not just the dist
    versions["cuda"] = torch.version.cuda
    versions["python"] = platform.python_version()
    return versions


def gpu_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def gpu_slug(name: str) -> str:
    """"NVIDIA H200" -> "h200": the results folder of a GPU model."""
    s = name.lower()
    for prefix in ("nvidia ", "geforce "):
        s = s.replace(prefix, "")
    out = "".join(c if c.isalnum() else "-" for c in s).strip("-")
    while "--" in out:
        out = out.replace("--", "-")
    return out or "unknown"


def loaded_anchor_modules() -> list[str]:
    return [m for m in ("fla", "flash_qla", "flashinfer") if m in sys.modules]
