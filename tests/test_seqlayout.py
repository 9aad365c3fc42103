"""gdnkit.seqlayout: the chunk tables of a packed batch, and the one host read per cu_seqlens tensor."""
from __future__ import annotations

import os

import pytest
import torch
from torch.overrides import TorchFunctionMode

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any triton kernel is defined

from gdnkit import seqlayout  # noqa: E402
from gdnkit.problem import CHUNK_MODE, validate_inputs  # noqa: E402


def _tables_by_hand(offsets):
    rows, starts = [], [0]
    for n, (s, e) in enumerate(zip(offsets[:-1], offsets[1:])):
        count = -(-(e - s) // 64)
        rows += [[n, c] for c in range(count)]
        starts.append(starts[-1] + count)
    return rows, starts


@pytest.mark.parametrize("offsets", [[0, 1, 65, 200, 200, 260], [0, 0], [0, 64], [0, 5000, 5001]])
def test_tables_match_a_hand_count(offsets):
    layout = seqlayout.sequence_layout(torch.tensor(offsets))
    rows, starts = _tables_by_hand(offsets)
    assert layout.offsets == tuple(offsets) and layout.n_chunks == len(rows)
    assert layout.chunk_indices.tolist() == rows and layout.chunk_indices.dtype == torch.int32
    assert layout.chunk_offsets.tolist() == starts and layout.cu_seqlens.tolist() == offsets
    assert layout.lengths == [e - s for s, e in zip(offsets[:-1], offsets[1:])]


def test_dense_layout_is_the_packed_one():
    dense = seqlayout.dense_layout(3, 130, torch.device("cpu"))
    packed = seqlayout.sequence_layout(torch.tensor([0, 130, 260, 390]))
    for name in ("cu_seqlens", "chunk_indices", "chunk_offsets"):
        assert torch.equal(getattr(dense, name), getattr(packed, name))
    assert seqlayout.dense_layout(3, 130, torch.device("cpu")) is dense


def test_layouts_are_keyed_on_content():
    cu = torch.tensor([0, 10, 100])
    first = seqlayout.sequence_layout(cu)
    assert seqlayout.sequence_layout(cu) is first
    assert seqlayout.sequence_layout(cu.clone()) is first  # equal offsets: the same layout, whatever tensor
    assert seqlayout.sequence_layout(first.cu_seqlens) is first  # the layout's own copy finds it


@pytest.mark.parametrize("write", ["index", "numpy", "data", "inference"])
def test_host_tensor_writes_of_every_kind_are_seen(write):
    """A CPU cu_seqlens is read every call: writes that do not move torch's version counter are seen too."""
    if write == "numpy":
        pytest.importorskip("numpy")
    if write == "inference":
        with torch.inference_mode():
            cu = torch.tensor([0, 10, 100])
    else:
        cu = torch.tensor([0, 10, 100])
    assert seqlayout.sequence_layout(cu).offsets == (0, 10, 100)
    if write == "index":
        cu[1] = 70
    elif write == "numpy":
        cu.numpy()[1] = 70
    elif write == "data":
        cu.data[1] = 70
    else:
        with torch.inference_mode():
            cu[1] = 70
    assert seqlayout.host_offsets(cu) == (0, 70, 100)
    assert seqlayout.sequence_layout(cu).offsets == (0, 70, 100)


@pytest.fixture
def cached_path(monkeypatch):
    """The per-tensor cache GPU tensors take (a host read is a sync there), exercised on host tensors."""
    monkeypatch.setattr(seqlayout, "_read_every_call", lambda t: False)
    monkeypatch.setattr(seqlayout, "_entries", [])


def _reads(monkeypatch):
    calls = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: calls.append(1) or tolist(t))
    return calls


def test_cached_path_reads_once_per_version(cached_path, monkeypatch):
    reads = _reads(monkeypatch)
    buffer = torch.tensor([0, 10, 100, 100])
    cu = buffer[:3]
    assert seqlayout.sequence_layout(cu).offsets == (0, 10, 100) and len(reads) == 1
    assert seqlayout.sequence_layout(cu).offsets == (0, 10, 100) and len(reads) == 1
    # a new view of the same memory (an engine slicing its buffer each step) shares the version: no read
    assert seqlayout.host_offsets(buffer[:3]) == (0, 10, 100) and len(reads) == 1
    # an engine rewriting its preallocated buffer in place (copy_ bumps the version): read again, never stale
    buffer.copy_(torch.tensor([0, 30, 60, 90]))
    assert seqlayout.sequence_layout(buffer[:3]).offsets == (0, 30, 60) and len(reads) == 2
    assert seqlayout.sequence_layout(cu).offsets == (0, 30, 60) and len(reads) == 2


def test_cached_path_rereads_inference_tensors(cached_path, monkeypatch):
    """Inference tensors have no version counter: read every call (the defect: reading _version raised)."""
    reads = _reads(monkeypatch)
    with torch.inference_mode():
        cu = torch.tensor([0, 10, 100])
        assert seqlayout.sequence_layout(cu).offsets == (0, 10, 100)
        cu[1] = 50
        assert seqlayout.sequence_layout(cu).offsets == (0, 50, 100)
    assert len(reads) == 2


@pytest.mark.parametrize("write", ["numpy", "data"])
def test_cached_path_catches_writes_torch_cannot_see(cached_path, write):
    """A write that leaves the version alone keeps the cached offsets; the device check that every cached
    layout enqueues (torch._assert_async: synchronous on a host tensor, a device assert on a GPU) fails."""
    if write == "numpy":
        pytest.importorskip("numpy")
    cu = torch.tensor([0, 10, 100])
    seqlayout.sequence_layout(cu)
    if write == "numpy":
        cu.numpy()[1] = 70
    else:
        cu.data[1] = 70
    with pytest.raises(RuntimeError):
        seqlayout.sequence_layout(cu)


def test_cache_stays_bounded(cached_path):
    tensors = [torch.tensor([0, n, 200]) for n in range(3 * seqlayout.CACHED_TENSORS)]
    for cu in tensors:
        seqlayout.sequence_layout(cu)
    assert len(seqlayout._entries) <= seqlayout.CACHED_TENSORS
    assert len(seqlayout._layouts) <= seqlayout.LAYOUTS_KEPT
    del tensors, cu
    seqlayout.sequence_layout(torch.tensor([0, 1]))
    assert len(seqlayout._entries) == 1  # dead tensors leave the cache (a weak reference each)


def test_inference_mode_varlen_calls():
    """Both public calls under torch.inference_mode with an inference cu_seqlens (they raised before)."""
    import gdnkit
    with torch.inference_mode():
        x = torch.randn(1, 4, 1, 8)
        g, b = -torch.rand(1, 4, 1), torch.rand(1, 4, 1)
        cu = torch.tensor([0, 1, 4])
        for fn in (gdnkit.chunk_gated_delta_rule, gdnkit.fused_recurrent_gated_delta_rule):
            o, _ = fn(x, x, x, g, b, cu_seqlens=cu)
            assert o.shape == x.shape and torch.isfinite(o).all()


class _HostReads(TorchFunctionMode):
    """Records every Tensor -> Python value conversion (each is a host sync on a GPU tensor)."""
    READS = {"tolist", "item", "__int__", "__bool__", "__index__", "__float__"}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("segment_chunks", [None, 1], ids=["plain", "context-parallel"])
def test_repeated_varlen_call_reads_nothing_back(segment_chunks, monkeypatch, cached_path):
    """Validation plus the triton_generic forward (interpreted on a CPU, through the per-tensor cache a GPU
    tensor takes; the same host code runs before a GPU launch): the first call with a cu_seqlens tensor reads
    its offsets, the second reads nothing, which is what lets a warmed-up call be captured in a CUDA graph."""
    pytest.importorskip("triton")
    from gdnkit.backends.triton_generic import BACKEND, chunked
    monkeypatch.setattr(chunked, "CP_SEGMENT_CHUNKS", segment_chunks)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    T, H, HV, K = 150, 1, 2, 16
    r = lambda *s: torch.randn(*s, generator=gen).to(dev)  # noqa: E731
    args = (r(1, T, H, K), r(1, T, H, K), r(1, T, HV, K), -torch.rand(1, T, HV, generator=gen).to(dev),
            torch.rand(1, T, HV, generator=gen).to(dev))
    cu = torch.tensor([0, 1, 80, 150], device=dev)

    def call():
        with _HostReads() as reads:
            problem, inputs = validate_inputs(CHUNK_MODE, *args, cu_seqlens=cu, output_final_state=True)
            BACKEND.chunk_forward(problem, inputs)
        return reads.calls

    assert "tolist" in call()
    assert call() == []


_MISMATCH = """
import sys, torch
from gdnkit.backends.triton_shared.offsets_check import assert_offsets_agree
n, at = int(sys.argv[1]), int(sys.argv[2])
own = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randint(0, 200, (n - 1,)).cumsum(0)]).int().cuda()
cu = own.long()
cu[at] += 1
assert_offsets_agree(cu, own)
torch.cuda.synchronize()
print("NOT CAUGHT")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 17, 1024, 3000])   # one block, a partial one, exactly one, three with a tail
def test_offsets_check_in_one_launch(n):
    """triton_shared/offsets_check.py: equal offsets (int32 or int64 against the layout's int32 copy) pass; one
    differing entry, first, in the middle or in the last partial block, ends in a device-side assert (in a
    process of its own: the assert ends the CUDA context)."""
    import subprocess
    import sys
    from gdnkit.backends.triton_shared.offsets_check import assert_offsets_agree
    # random offsets, as a packed batch's: 0, then lengths of 0-199 tokens summed
    own = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randint(0, 200, (n - 1,)).cumsum(0)]).int().cuda()
    for cu in (own.clone(), own.long()):
        assert_offsets_agree(cu, own)
    torch.cuda.synchronize()
    for at in sorted({0, n // 2, n - 1}) if n in (2, 3000) else ():   # each a process of its own: a few
        run = subprocess.run([sys.executable, "-c", _MISMATCH, str(n), str(at)], capture_output=True, text=True,
                             timeout=300)
        assert "NOT CAUGHT" not in run.stdout
        assert run.returncode != 0 and "device-side assert" in run.stderr + run.stdout, run.stderr[-2000:]
