"""FLA's own functions computed by gdnkit, through FLA's backend registry (the mechanism FLA uses for FlashQLA).

    import gdnkit.integrations.fla
    gdnkit.integrations.fla.enable()     # fla.ops.gated_delta_rule.chunk_gated_delta_rule now runs gdnkit

FLA 0.6 dispatches `chunk_gated_delta_rule` through its registry for the `gated_delta_rule` operation; every
enabled backend is asked in priority order whether it takes a call (its verifier), and the first that does runs it.
gdnkit registers as the backend "gdnkit" ahead of FlashQLA. Its verifier declines calls gdnkit does not implement
(FLA's context parallelism, per-key decays) and GPU calls for which gdnkit has only its float64-exact reference
backend: FLA's own kernels run those, as they would without gdnkit. On the CPU FLA has no kernels, so gdnkit takes
every call it can validate. FLA 0.6 does not dispatch `fused_recurrent_gated_delta_rule`; the backend provides it
for FLA versions that do.

`FLA_GDNKIT=0` (FLA's per-backend switch) turns the registered backend off without a code change; `disable()`
does the same from Python. `calls` counts the calls gdnkit served.
"""
from __future__ import annotations

import collections
import logging

import torch

import gdnkit

log = logging.getLogger(__name__)

BACKEND_TYPE = "gdnkit"
ENV_VAR = "FLA_GDNKIT"
OPERATION = "gated_delta_rule"
PRIORITY = 2  # FLA: lower runs first; FlashQLA is 3, Ascend's (NPU only) 0

calls: collections.Counter = collections.Counter()
_backend_class = None  # registered once; FLA keeps an instance of it


# FLA's keywords that gdnkit does not implement; the verifier declines them so FLA's kernels run the call.
_DECLINED = ("cp_context", "gk", "gv")


def _verify(mode: str, *args, **kwargs) -> tuple[bool, str | None]:
    for name in _DECLINED:
        if kwargs.get(name) is not None:
            return False, f"gdnkit does not implement {name}"
    q = args[0] if args else kwargs.get("q")
    if mode != "chunk" or not isinstance(q, torch.Tensor) or not q.is_cuda:
        return True, None  # FLA has no kernels off the GPU: gdnkit's validation speaks for the call
    try:
        chosen = _chunk_decision(*args, **kwargs).chosen
    except (TypeError, ValueError) as error:
        return False, f"gdnkit rejects the call: {error}"
    if chosen == "reference":
        return False, "gdnkit has no GPU backend for this call (only its float64-exact reference)"
    return True, None


_OPTIONS = ("use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first",
            "cu_seqlens", "use_gate_in_kernel", "A_log", "dt_bias")


def _chunk_decision(*args, **kwargs):
    """gdnkit.explain for a chunk_gated_delta_rule call as FLA received it (gdnkit's function has FLA's order)."""
    import inspect

    bound = inspect.signature(gdnkit.chunk_gated_delta_rule).bind(*args, **kwargs).arguments
    options = {name: bound[name] for name in _OPTIONS if name in bound}
    if bound.get("hints", {}).get("transpose_state_layout"):
        options["state_v_first"] = True
    return gdnkit.explain(bound["q"], bound["k"], bound["v"], bound["g"], bound["beta"], bound.get("scale"),
                          bound.get("initial_state"), bound.get("output_final_state", False), **options)


def _make_backend():
    from fla.backends import BaseBackend

    class GdnkitBackend(BaseBackend):
        """gdnkit's kernels behind FLA's gated_delta_rule functions."""

        backend_type = BACKEND_TYPE
        package_name = "gdnkit"
        env_var = ENV_VAR
        default_enable = True
        priority = PRIORITY

        active = True  # switched by enable()/disable(); FLA holds the instance, the class is ours

        def is_enabled(self) -> bool:
            return type(self).active and super().is_enabled()

        def chunk_gated_delta_rule_verifier(self, *args, **kwargs):
            return _verify("chunk", *args, **kwargs)

        def fused_recurrent_gated_delta_rule_verifier(self, *args, **kwargs):
            return _verify("recurrent", *args, **kwargs)

        def chunk_gated_delta_rule(self, *args, **kwargs):
            calls["chunk_gated_delta_rule"] += 1
            return gdnkit.chunk_gated_delta_rule(*args, **kwargs)

        def fused_recurrent_gated_delta_rule(self, *args, **kwargs):
            calls["fused_recurrent_gated_delta_rule"] += 1
            return gdnkit.fused_recurrent_gated_delta_rule(*args, **kwargs)

    return GdnkitBackend


def enable() -> None:
    """Register gdnkit in FLA's gated_delta_rule registry (once) and switch it on."""
    global _backend_class
    if _backend_class is None:
        import fla.ops.gated_delta_rule  # noqa: F401  (FLA builds the operation's registry on import)
        from fla.backends import register

        _backend_class = register(OPERATION)(_make_backend())
        log.debug("gdnkit registered in FLA's %s backends (priority %d)", OPERATION, PRIORITY)
    _backend_class.active = True


def disable() -> None:
    """Switch the registered backend off: FLA's functions run FLA's own kernels again."""
    if _backend_class is not None:
        _backend_class.active = False


def is_enabled() -> bool:
    return _backend_class is not None and _backend_class().is_enabled()
