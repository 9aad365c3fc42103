"""triton_shared.launch.enqueue: Triton launches that skip JITFunction.run's per-call work must run exactly the build
Triton itself would run for the same arguments (its specialisation on alignment, integer values, dtypes, compile-time
arguments and launch options), compute what kernel[grid] computes, stay capturable in a CUDA graph, and step aside
while a launch hook (a profiler) is installed."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402

from gdnkit.backends.triton_shared import launch  # noqa: E402


def _affine(x, y, n, alpha, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y + offs, tl.load(x + offs, mask=mask) * alpha + 1.0, mask=mask)


class _Compiled:
    """A compiled kernel's stand-in: records its launches."""
    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


def test_bound_launches_follow_tritons_own_specialisation(monkeypatch):
    """On a CPU, Triton's real argument binder (built for sm90) over a JITFunction whose compile and launch are
    stand-ins: a launch goes through Triton's run exactly once per specialisation (dtype, 16-byte alignment, an
    integer's value class, compile-time arguments, options), and every other launch reaches the compiled kernel's
    launcher with the grid padded to three axes, the current stream, no hooks and every argument in order,
    compile-time ones and defaults included."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    kernel = JITFunction(_affine)
    backend = make_backend(GPUTarget("cuda", 90, 32))
    kernel.device_caches[0] = ({}, {}, None, backend,
                               create_function_from_signature(kernel.signature, kernel.params, backend))
    builds = []

    def tritons_run(*args, grid, warmup, **kwargs):
        builds.append((grid, args, kwargs))
        return _Compiled()

    monkeypatch.setattr(kernel, "run", tritons_run)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    monkeypatch.setattr(launch, "BOUND_LAUNCHES", True)
    monkeypatch.setattr(launch, "_compiled", {})

    base = torch.zeros(64)
    x, y = base[:16], torch.zeros(16)
    first = launch.enqueue(kernel, (4,), x, y, 16, 2.0, BLOCK=32)
    assert len(builds) == 1 and first.launches == []
    again = launch.enqueue(kernel, (5, 2), x, y, 32, -1.0, BLOCK=32)      # 32: divisible by 16, as 16 was
    assert again is first and len(builds) == 1
    assert first.launches == [(5, 2, 1, 77, "function", "metadata", None, None, None, x, y, 32, -1.0, 32, False)]

    others = [((base[1:17], y, 16, 2.0), {"BLOCK": 32}),      # x off 16-byte alignment
              ((x, y, 1, 2.0), {"BLOCK": 32}),                # n == 1
              ((x, y, 17, 2.0), {"BLOCK": 32}),               # n not a multiple of 16
              ((x.double(), y, 16, 2.0), {"BLOCK": 32}),      # another dtype
              ((x, y, 16, 2.0), {"BLOCK": 64}),               # another compile-time argument
              ((x, y, 16, 2.0), {"BLOCK": 32, "FLAG": True}),
              ((x, y, 16, 2.0), {"BLOCK": 32, "num_warps": 2})]
    for args, kwargs in others:
        built = len(builds)
        compiled = launch.enqueue(kernel, (1,), *args, **kwargs)
        assert len(builds) == built + 1, f"{kwargs} reused another specialisation's build"
        assert launch.enqueue(kernel, (1,), *args, **kwargs) is compiled and len(builds) == built + 1
        assert len(compiled.launches) == 1

    # a launch hook installed (a profiler's): every launch through Triton's run
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        hook = lambda metadata: None  # noqa: E731
        chain.add(hook)
        try:
            launch.enqueue(kernel, (4,), x, y, 16, 2.0, BLOCK=32)
        finally:
            chain.remove(hook)
        assert len(builds) == 1 + len(others) + 1 and first.launches[1:] == []


_affine_kernel_gpu = triton.jit(_affine)   # the same kernel, launched on a GPU by the tests below


def _call(x, y, alpha=2.0, block=128, **options):
    n = x.numel()
    return launch.enqueue(_affine_kernel_gpu, (triton.cdiv(n, block),), x, y, n, alpha, BLOCK=block, **options)


def _poisoned(like):
    return torch.full_like(like, float("nan"))


@pytest.fixture
def bound(monkeypatch):
    monkeypatch.setattr(launch, "BOUND_LAUNCHES", True)
    monkeypatch.setattr(launch, "_compiled", {})


@pytest.mark.gpu
def test_bound_launch_reuses_tritons_own_build_and_computes_the_same(bound):
    torch.manual_seed(0)
    base = torch.randn(4099, device="cuda")
    x = base[:4000]
    y = _poisoned(x)
    first = _call(x, y)
    torch.testing.assert_close(y, x * 2 + 1)
    y = _poisoned(x)
    again = _call(x, y, alpha=-0.5)          # the bound path: same specialisation, another float value
    assert again is first and len(launch._compiled) == 1
    torch.testing.assert_close(y, x * -0.5 + 1)

    # a pointer off 16-byte alignment, n == 1, another BLOCK, other warps: each is another build of Triton's,
    # and the bound path must run that one, never the first
    cases = [(base[1:4001], {}), (base[:1], {}), (x, {"block": 256}), (x, {"num_warps": 2})]
    builds = {id(first)}
    for xi, kw in cases:
        for _ in range(2):                   # the first call binds, the second runs bound
            yi = _poisoned(xi)
            compiled = _call(xi, yi, **kw)
            torch.testing.assert_close(yi, xi * 2 + 1)
        n, block = xi.numel(), kw.get("block", 128)
        tritons = _affine_kernel_gpu[(triton.cdiv(n, block),)](xi, yi, n, 2.0, BLOCK=block,
                                                           **{k: v for k, v in kw.items() if k != "block"})
        assert compiled is tritons, "the bound path ran another build than Triton picks for these arguments"
        builds.add(id(compiled))
    assert len(builds) == 1 + len(cases)


@pytest.mark.gpu
def test_bound_launch_replays_in_a_cuda_graph(bound):
    x = torch.randn(1000, device="cuda")
    y = _poisoned(x)
    _call(x, y)   # bind outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _call(x, y, alpha=3.0)
    x.copy_(torch.randn_like(x))
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x * 3 + 1)


@pytest.mark.gpu
def test_a_launch_hook_sees_every_launch(bound):
    x = torch.randn(256, device="cuda")
    _call(x, _poisoned(x))
    seen = []
    hook = seen.append
    chain = knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip("this Triton keeps one launch hook, not a chain")
    chain.add(hook)
    try:
        _call(x, _poisoned(x))
        _call(x, _poisoned(x))
    finally:
        chain.remove(hook)
    assert len(seen) == 2
    assert not launch._hooked(knobs.runtime.launch_enter_hook)


@pytest.mark.gpu
def test_switched_off_every_launch_goes_through_triton(monkeypatch):
    monkeypatch.setattr(launch, "BOUND_LAUNCHES", False)
    monkeypatch.setattr(launch, "_compiled", {})
    x = torch.randn(300, device="cuda")
    for _ in range(2):
        y = _poisoned(x)
        _call(x, y)
        torch.testing.assert_close(y, x * 2 + 1)
    assert launch._compiled == {}
