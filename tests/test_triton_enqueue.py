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

pytestmark = pytest.mark.gpu


@triton.jit
def _affine_kernel(x, y, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y + offs, tl.load(x + offs, mask=mask) * alpha + 1.0, mask=mask)


def _call(x, y, alpha=2.0, block=128, **options):
    n = x.numel()
    return launch.enqueue(_affine_kernel, (triton.cdiv(n, block),), x, y, n, alpha, BLOCK=block, **options)


def _poisoned(like):
    return torch.full_like(like, float("nan"))


@pytest.fixture
def bound(monkeypatch):
    monkeypatch.setattr(launch, "BOUND_LAUNCHES", True)
    monkeypatch.setattr(launch, "_compiled", {})


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
        tritons = _affine_kernel[(triton.cdiv(n, block),)](xi, yi, n, 2.0, BLOCK=block,
                                                           **{k: v for k, v in kw.items() if k != "block"})
        assert compiled is tritons, "the bound path ran another build than Triton picks for these arguments"
        builds.add(id(compiled))
    assert len(builds) == 1 + len(cases)


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


def test_switched_off_every_launch_goes_through_triton(monkeypatch):
    monkeypatch.setattr(launch, "BOUND_LAUNCHES", False)
    monkeypatch.setattr(launch, "_compiled", {})
    x = torch.randn(300, device="cuda")
    for _ in range(2):
        y = _poisoned(x)
        _call(x, y)
        torch.testing.assert_close(y, x * 2 + 1)
    assert launch._compiled == {}
