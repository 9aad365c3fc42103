"""How gdnkit launches Triton kernels: enqueue, the path every launch takes (below), and the launch settings
(num_warps, num_stages) of the chunked Triton kernels (triton_generic's and triton_shared's) in one table (the
token-by-token kernel, recurrence.py, sizes its own launches by its state tile: launch_config).

Fixed per kernel, not autotuned at call time: autotuning costs the first call seconds per shape, may pick
differently from one process to the next (results not bitwise repeatable across runs) and cannot run while
a CUDA graph is captured. The values are H200 sweeps (docs/performance.md, triton_generic); on another GPU,
GDNKIT_TRITON_LAUNCH overrides entries for tuning: "output=4x2,backward_chunk=8x1" (warps x stages).

Stages only matter for kernels with a runtime loop (the sequential passes walk their chunks in one); where
a kernel unrolls its loops only the warp count counts. Stages cost shared memory: where a GPU has less than
the H200 (sm86/sm89/sm120: 99 KB a block; fp32's backward_chunk takes 128 KB at 3 stages there, Triton 3.6),
launch() retries at fewer stages and remembers what ran.
"""
from __future__ import annotations

import functools
import os

import torch
from triton import knobs
from triton.runtime.errors import OutOfResources

SIXTEEN_BIT = {
    # H200 (a sweep over 2/4/8 warps x 1/2/3 stages, docs/performance.md; per-kernel device time, ms, at 16/64
    # 1x32768 unless named): fewer warps than the 8 of the first version win almost everywhere
    "kkt": (4, 2),             # 0.490 -> 0.355 (8 -> 4 warps; 197 registers, no spills)
    "diag_inverse": (1, 3),    # one warp per 16 x 16 block: 64 registers, no barriers (2 warps add 3 a row)
    "solve": (2, 2),           # 0.476 (8) / 0.417 (4) / 0.320 (2): its spills at 2 warps cost less than its barriers
    "w_u": (4, 2),             # 0.748 -> 0.729
    "state": (4, 3),           # the state pass alone (and the propagator pass): 8/32 1x32768 0.844 (4x2) -> 0.789
    "fused": (4, 3),           # the state pass with the output fused in: 2.48 (8x1) -> 1.354
    "reverse": (4, 3),         # the backward's reverse pass, 16/32 1x32768: 1.723 (4x1) -> 1.388; the 4x1, 4x2 and
                               # 4x3 builds all pass test_reverse_pass_build_matches_its_arithmetic on the H200;
                               # Triton 3.6 has miscompiled other forms of this kernel
    "output": (4, 2),          # 64-wide V blocks: 2.840 (8) / 1.486 (4) / 1.439 (2); 128-wide (output.BLOCK_V): 1.04
    "local_du": (4, 2),        # 16/32 1x32768: 0.809 -> 0.454
    "backward_chunk": (4, 3),  # 16/32 1x32768: 2.787 (8x1) -> 1.671
    "backward_wy": (4, 3),     # 16/32 1x32768: 2.261 -> 1.369
    "segment_scan": (4, 1),    # P [K, K] fp32 through shared memory: one stage keeps it at ~80 KB (sm86/89)
    "l2norm": (4, 1),          # l2norm.py's row passes, [ROWS, BK] tiles of 4096 values, no loop (not swept yet)
}
# fp32 tiles take twice the shared memory: the sequential passes stay at one stage (under Ada's ~99 KB a
# block), with 8 warps for their doubled registers
FP32 = {**SIXTEEN_BIT, "state": (8, 1), "fused": (8, 1), "reverse": (8, 1)}


@functools.lru_cache(maxsize=8)
def _overrides(spec: str) -> dict[str, tuple[int, int]]:
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, value = item.partition("=")
        warps, _, stages = value.partition("x")
        if name not in SIXTEEN_BIT or not warps.isdigit() or not stages.isdigit():
            raise ValueError(f"GDNKIT_TRITON_LAUNCH: {item!r} is not <kernel>=<warps>x<stages> with a kernel "
                             f"among {sorted(SIXTEEN_BIT)}")
        out[name] = (int(warps), int(stages))
    return out


def settings(kernel: str, dtype: torch.dtype) -> dict[str, int]:
    """num_warps / num_stages for one launch of `kernel` on inputs of `dtype`."""
    table = FP32 if dtype == torch.float32 else SIXTEEN_BIT
    warps, stages = _overrides(os.environ.get("GDNKIT_TRITON_LAUNCH", "")).get(kernel, table[kernel])
    return {"num_warps": warps, "num_stages": stages}


# (kernel, dtype, device, override, compile-time arguments) -> settings that fit, where the table's did not
_FITTED: dict[tuple, dict[str, int]] = {}


def launch(kernel_name: str, dtype: torch.dtype, kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs) at the table's settings for kernel_name. Triton raises OutOfResources
    before anything runs when a build needs more shared memory than the GPU has; then one stage fewer, down to
    one, and the settings that fit are kept for the next calls of the same build (no retry per call, none
    inside a CUDA graph capture after the first call)."""
    chosen = settings(kernel_name, dtype)
    key = _build_key(kernel_name, dtype, kwargs) if _FITTED else None  # none on record: nothing to look up
    chosen = _FITTED.get(key, chosen)
    while True:
        try:
            return enqueue(kernel, grid, *args, **kwargs, **chosen)
        except OutOfResources:
            if chosen["num_stages"] <= 1:
                raise
            chosen = {**chosen, "num_stages": chosen["num_stages"] - 1}
            _FITTED[key or _build_key(kernel_name, dtype, kwargs)] = chosen


def _build_key(kernel_name: str, dtype: torch.dtype, kwargs: dict) -> tuple:
    """A build's identity for _FITTED: its shared memory depends on its compile-time arguments (block sizes,
    flags), the device and the launch override too."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else -1
    build = tuple(sorted((n, v) for n, v in kwargs.items() if isinstance(v, (bool, int, str))))
    return kernel_name, dtype, device, os.environ.get("GDNKIT_TRITON_LAUNCH", ""), build


# An eager launch through Triton's JITFunction.run re-reads environment knobs, runs the pre-run hooks, rebuilds
# the cache key's string, checks the kernel's globals and calls the (empty) launch hook chain, each call. Skipping
# that saved ~20-30 us a launch on the H100's host: an sm90 training step 1.712 -> 1.508 ms with its 7 Triton
# launches (benchmarks/results/h100/host-time.md, GDNKIT_TRITON_BOUND=0 against the default in one process).
# enqueue() keeps Triton's own argument binder (its specialisation on dtypes, 16-byte alignment and integer
# values is the build's identity, so a bound build is only ever reused where Triton would reuse it) and calls the
# compiled kernel's launcher directly. The first call of each specialisation, and every call while a launch hook
# is installed (a profiler's), goes through kernel[grid] unchanged; Triton's environment knobs (TRITON_DEBUG, its
# instrumentation) are read there, at a specialisation's first launch in the process.
BOUND_LAUNCHES = os.environ.get("GDNKIT_TRITON_BOUND", "1") != "0"   # "0": every launch through kernel[grid]
# (id of the kernel, device, specialisation, options) -> Triton's CompiledKernel for them (jit kernels are module
# globals, alive as long as the process)
_compiled: dict[tuple, object] = {}


def enqueue(kernel, grid: tuple[int, ...], *args, **kwargs):
    """kernel[grid](*args, **kwargs) with the compiled kernel looked up by Triton's own specialisation of the
    arguments, without JITFunction.run's per-call work (module note above). Returns the compiled kernel."""
    caches = getattr(kernel, "device_caches", None) if BOUND_LAUNCHES else None
    if caches is None or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
        return kernel[grid](*args, **kwargs)   # the interpreter's kernels have no device caches
    device = torch.cuda.current_device()
    per_device = caches.get(device)   # (cache, key cache, target, backend, binder): made by the first launch
    if per_device is None or len(per_device) != 5:   # (another layout: a Triton this was not written against)
        return kernel[grid](*args, **kwargs)
    bound, specialization, options = per_device[4](*args, **kwargs)
    try:
        key = (id(kernel), device, tuple(specialization), tuple(options.items()))
        compiled = _compiled.get(key)
    except TypeError:   # an unhashable specialisation value: Triton's own path
        return kernel[grid](*args, **kwargs)
    if compiled is None:
        compiled = kernel[grid](*args, **kwargs)
        _compiled[key] = compiled
        return compiled
    args = tuple(bound.values())
    stream = torch._C._cuda_getCurrentRawStream(device)
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    # no launch metadata and no hooks: both only feed hooks, and none is installed (checked above)
    compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)
    return compiled


def _hooked(hook) -> bool:
    """Whether a launch hook is installed: Triton keeps an empty HookChain (its `calls`) when none is; an older
    Triton keeps None or the hook itself."""
    return hook is not None and bool(getattr(hook, "calls", True))
