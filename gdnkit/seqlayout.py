"""Where the sequences of a packed (varlen) batch and their 64-token chunks lie, read once per cu_seqlens.

Chunked kernels launch one program per chunk from a (sequence, chunk-within-sequence) table, and the
host decides launch shapes from the sequence lengths. Both come from cu_seqlens, which lives on the GPU:
reading it costs a host sync, and a sync inside a CUDA-graph capture breaks the capture. So the offsets
are read once per cu_seqlens tensor and kept, with the device tables built from them, keyed on the tensor
itself (identity and in-place version, as FLA keys its index tables). A caller that reuses one cu_seqlens
tensor across calls (a serving engine's batch metadata, a benchmark's input sets) pays the read once,
and every later call, validation included, reads nothing back and can be captured. Fixed-length batches
need no read at all (dense_layout).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

CHUNK = 64
CACHED_TENSORS = 8  # distinct cu_seqlens tensors remembered (most recent kept)


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, usable as a cache key
class SequenceLayout:
    offsets: tuple[int, ...]        # cu_seqlens on the host
    cu_seqlens: torch.Tensor        # [N + 1] int32 on the device
    chunk_indices: torch.Tensor     # [n_chunks, 2] int32: (sequence, chunk within the sequence)
    chunk_offsets: torch.Tensor     # [N + 1] int32: row of chunk_indices where each sequence starts

    @property
    def n_chunks(self) -> int:
        return self.chunk_indices.shape[0]

    @property
    def lengths(self) -> list[int]:
        return [e - s for s, e in zip(self.offsets[:-1], self.offsets[1:])]

    @property
    def chunk_counts(self) -> list[int]:
        """Chunks per sequence (a partial last chunk counts)."""
        return _chunk_counts(self.offsets)


def _chunk_counts(offsets) -> list[int]:
    return [-(-(e - s) // CHUNK) for s, e in zip(offsets[:-1], offsets[1:])]


def _build(offsets: list[int] | tuple[int, ...], device: torch.device) -> SequenceLayout:
    """From host offsets: the device tables without reading anything back (sizes are known here)."""
    counts = _chunk_counts(offsets)
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    total = starts[-1]
    chunk_offsets = torch.tensor(starts, dtype=torch.int32, device=device)
    seq = torch.repeat_interleave(torch.arange(len(counts), device=device),
                                  torch.tensor(counts, dtype=torch.long, device=device), output_size=total)
    within = torch.arange(total, device=device) - chunk_offsets[:-1].long()[seq]
    return SequenceLayout(tuple(offsets), torch.tensor(offsets, dtype=torch.int32, device=device),
                          torch.stack([seq, within], 1).to(torch.int32).contiguous(), chunk_offsets)


@dataclasses.dataclass
class _Entry:
    tensor: torch.Tensor
    version: int
    offsets: tuple[int, ...]
    layout: SequenceLayout | None = None


_entries: list[_Entry] = []


def _entry(cu_seqlens: torch.Tensor) -> _Entry:
    for entry in _entries:
        if entry.tensor is cu_seqlens and entry.version == cu_seqlens._version:
            return entry
    if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("cu_seqlens is new to gdnkit while a CUDA graph is being captured: reading its offsets "
                           "would break the capture. Call once with this same tensor before capturing.")
    entry = _Entry(cu_seqlens, cu_seqlens._version, tuple(cu_seqlens.tolist()))
    _entries.append(entry)
    del _entries[:-CACHED_TENSORS]
    return entry


def host_offsets(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """cu_seqlens on the host: one read per tensor, then from the cache."""
    return _entry(cu_seqlens).offsets


def sequence_layout(cu_seqlens: torch.Tensor) -> SequenceLayout:
    """The layout of a packed batch; the offsets must be valid (gdnkit.problem checks them first)."""
    entry = _entry(cu_seqlens)
    if entry.layout is None:
        entry.layout = _build(entry.offsets, cu_seqlens.device)
    return entry.layout


def packed_output(shape, cu_seqlens: torch.Tensor | None, *, token_dim: int = 1, **kwargs) -> torch.Tensor:
    """An output the kernels write at every token of every sequence: allocated empty, and for varlen inputs
    only the tokens past cu_seqlens[-1] (no sequence's; their outputs and gradients are zero) are zeroed.
    Zero-filling all of it would cost one more full pass over the tensor. Offsets count tokens over the
    batch and token dims together (context parallelism runs dense [B, T] inputs as packed segments)."""
    out = torch.empty(shape, **kwargs)
    if cu_seqlens is not None:
        batch_dim = token_dim - 1
        end = host_offsets(cu_seqlens)[-1]
        past = shape[batch_dim] * shape[token_dim] - end
        if past:  # the usual packed call has none: three host ops saved, 8 times a training call
            out.flatten(batch_dim, token_dim).narrow(batch_dim, end, past).zero_()
    return out


@functools.lru_cache(maxsize=32)
def dense_layout(B: int, T: int, device: torch.device) -> SequenceLayout:
    """A [B, T] batch seen as B packed sequences of T tokens: built from the shape alone."""
    return _build([b * T for b in range(B + 1)], device)


def seq_bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of every sequence."""
    offsets = host_offsets(cu_seqlens)
    return list(zip(offsets[:-1], offsets[1:]))


def remember_host_offsets(cu_seqlens: torch.Tensor, host: torch.Tensor | list[int] | tuple[int, ...]) -> None:
    """Take a caller's host copy of cu_seqlens (FLA's cu_seqlens_cpu) instead of reading the device tensor.

    The caller vouches that `host` holds cu_seqlens' values, as FLA's callers do; a mismatched length is
    rejected. Nothing happens for a tensor already known.
    """
    if any(e.tensor is cu_seqlens and e.version == cu_seqlens._version for e in _entries):
        return
    offsets = tuple(int(x) for x in (host.tolist() if isinstance(host, torch.Tensor) else host))
    if len(offsets) != cu_seqlens.numel():
        raise ValueError(f"cu_seqlens_cpu must hold the {cu_seqlens.numel()} offsets of cu_seqlens, got {len(offsets)}")
    _entries.append(_Entry(cu_seqlens, cu_seqlens._version, offsets))
    del _entries[:-CACHED_TENSORS]
