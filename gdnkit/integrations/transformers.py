"""transformers' GDN layers computed by gdnkit: `enable()`, `disable()`, `with enabled():`.

Every transformers model with gated-delta-rule layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid, ...)
defines, in its modeling module, two module-level functions its layers call by name:
`torch_chunk_gated_delta_rule` (prefill, training, packed sequences through `cu_seq_lens_q`) and
`torch_recurrent_gated_delta_rule` (one-token decode with the cache). transformers decorates them so they resolve,
once at import, to a hub kernel, FLA's function (on the devices FLA supports) or the PyTorch loop under them. The
layers look those names up on every call, so rebinding them in the modeling module is the one point that catches
all three routes, on every device, without touching a model: that is what `enable()` does. The modules are found
by reading which modeling files define the two names, and imported (so a model loaded later is covered too).

`calls` counts the calls gdnkit served, per function (eager calls; a compiled model's are one gdnkit op each in
its graph); a debug-level log line names the first call of each.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import importlib.util
import logging
import pathlib

import torch

import gdnkit

log = logging.getLogger(__name__)

# transformers' name in a modeling module -> the gdnkit function that replaces it
_TARGETS = {"torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
            "torch_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule"}

calls: collections.Counter = collections.Counter()
_originals: dict[tuple[str, str], object] = {}  # (module name, attribute) -> what transformers had bound


def _count(name: str) -> None:
    if torch.compiler.is_compiling():  # a compiled model traces each call once; counting is for eager runs
        return
    if not calls[name]:
        log.debug("gdnkit computes transformers' %s", name)
    calls[name] += 1


# The replacements keep the signatures of the PyTorch functions they stand for (chunk_size is the sixth positional
# there), so any call a model makes means the same; the rest are keywords FLA's functions take (gdnkit.api).
def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, **kwargs):
    _count("chunk_gated_delta_rule")
    return gdnkit.chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=initial_state,
                                         output_final_state=output_final_state,
                                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)


def fused_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, **kwargs):
    _count("fused_recurrent_gated_delta_rule")
    return gdnkit.fused_recurrent_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=initial_state,
                                                   output_final_state=output_final_state,
                                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)


_REPLACEMENTS = {"chunk_gated_delta_rule": chunk_gated_delta_rule,
                 "fused_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule}


def gdn_modules() -> list[str]:
    """The modeling modules of the installed transformers that define the GDN functions (not imported)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("gdnkit.integrations.transformers needs transformers (pip install 'transformers>=5.17')")
    return [name for root in spec.submodule_search_locations for name in _defining_modules(root)]


@functools.lru_cache(maxsize=None)
def _defining_modules(root: str) -> tuple[str, ...]:
    found = []
    for path in sorted(pathlib.Path(root, "models").glob("*/modeling_*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if any(f"def {name}(" in text for name in _TARGETS):
            found.append(f"transformers.models.{path.parent.name}.{path.stem}")
    return tuple(found)


def enable() -> list[str]:
    """Route every transformers GDN layer to gdnkit; returns the modeling modules patched. Idempotent."""
    patched = []
    for module_name in gdn_modules():
        module = importlib.import_module(module_name)
        for attribute, target in _TARGETS.items():
            current = getattr(module, attribute, None)
            if current is None or current is _REPLACEMENTS[target]:
                continue
            _originals[(module_name, attribute)] = current
            setattr(module, attribute, _REPLACEMENTS[target])
        patched.append(module_name)
    log.debug("gdnkit serves the GDN layers of %s", ", ".join(patched))
    return patched


def disable() -> None:
    """Give transformers back its own functions."""
    while _originals:
        (module_name, attribute), original = _originals.popitem()
        setattr(importlib.import_module(module_name), attribute, original)


def is_enabled() -> bool:
    return bool(_originals)


@contextlib.contextmanager
def enabled():
    """`with enabled():` gdnkit inside the block; what was in place before comes back after it."""
    was = is_enabled()
    enable()
    try:
        yield calls
    finally:
        if not was:
            disable()
