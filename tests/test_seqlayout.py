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


def test_cached_per_tensor_and_version():
    cu = torch.tensor([0, 10, 100])
    first = seqlayout.sequence_layout(cu)
    assert seqlayout.sequence_layout(cu) is first
    assert seqlayout.sequence_layout(cu.clone()) is not first  # another tensor: read afresh
    cu[1] = 70  # in place: the version moves, the cached offsets are stale
    again = seqlayout.sequence_layout(cu)
    assert again is not first and again.offsets == (0, 70, 100)


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
def test_repeated_varlen_call_reads_nothing_back(segment_chunks, monkeypatch):
    """Validation plus the triton_generic forward (interpreted on a CPU; the same host code runs before a GPU
    launch): the first call with a cu_seqlens tensor reads its offsets, the second reads nothing, which
    is what lets a warmed-up call be captured in a CUDA graph."""
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
