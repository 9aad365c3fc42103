"""Where the sequences of a packed (varlen) batch and their 64-token chunks lie, and how cu_seqlens is read.

Chunked kernels launch one program per chunk from a (sequence, chunk-within-sequence) table, and the
host decides launch shapes from the sequence lengths. Both come from cu_seqlens. What may be cached, and
what a caller may rely on:

- Layouts are keyed on content: (device, offsets) -> SequenceLayout, a bounded cache. Equal offsets give
  the same layout object, whatever tensor they came in, so the plans cached per layout downstream
  (context-parallel segments) are shared, and a layout can never disagree with the offsets it was built
  from. Its device tables (and its own int32 copy of cu_seqlens, which the backends hand to their kernels
  in place of the caller's tensor) belong to gdnkit and are never written.
- A CPU cu_seqlens is read every call: the host copy is free, so nothing the caller does to it in place
  (cu.numpy()[i] = x, cu.data[...], inference-mode tensors) can ever be missed.
- A CUDA cu_seqlens costs a host sync to read, and a sync inside a CUDA-graph capture breaks the
  capture. So its offsets are kept per tensor (a weak reference to it, or a tensor of the same memory,
  and torch's in-place version counter, which views share) and read again only when torch saw a write:
  copy_, fill_, index assignment, out= all bump the version. A serving engine that rewrites one
  preallocated buffer in place every step is therefore re-read every eager step and never stale.
  Inference tensors (made under torch.inference_mode) have no version counter: they are re-read every
  eager call (one sync each).
- Writes torch cannot see (through .data, DLPack, a custom kernel) leave the host copy stale. Every
  chunked call with a caller's CUDA cu_seqlens therefore enqueues a device-side check
  (cu_seqlens == the layout's copy, in one Triton launch: triton_shared/offsets_check.py): no sync, capturable,
  and it cannot be fooled. A mismatch is a device-side assert, which ends the CUDA context: computing on with
  offsets that disagree with the tensor would be silently wrong, and no gentler signal exists without a sync.
- While a CUDA graph is being captured nothing is read: the offsets of the tensor's last eager call are
  used (a tensor gdnkit never read raises RuntimeError), and the device check above is captured with the
  call, so a replay after the buffer's values changed asserts instead of running stale launch shapes.
  The fused recurrent kernel (decode, serving) reads cu_seqlens on the device and needs no layout, so its
  captured graphs follow a buffer rewritten between replays.
Fixed-length batches need no read at all (dense_layout).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import weakref

import torch

CHUNK = 64
CACHED_TENSORS = 8  # distinct CUDA cu_seqlens tensors whose offsets are remembered (most recent kept)


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


LAYOUTS_KEPT = 32  # distinct (device, offsets) layouts remembered (most recently used kept)
_layouts: collections.OrderedDict[tuple, SequenceLayout] = collections.OrderedDict()
# a layout's own cu_seqlens copy -> the layout (weak: gone with the layout), so a backend that hands the copy on
# finds its layout without a read
_own_copies: weakref.WeakValueDictionary[int, SequenceLayout] = weakref.WeakValueDictionary()


def _layout_of(offsets: tuple[int, ...], device: torch.device) -> SequenceLayout:
    key = (device.type, device.index, offsets)
    layout = _layouts.get(key)
    if layout is None:
        layout = _layouts[key] = _build(offsets, device)
        _own_copies[id(layout.cu_seqlens)] = layout
        while len(_layouts) > LAYOUTS_KEPT:
            _layouts.popitem(last=False)
    _layouts.move_to_end(key)
    return layout


def _own_layout(cu_seqlens: torch.Tensor) -> SequenceLayout | None:
    layout = _own_copies.get(id(cu_seqlens))
    return layout if layout is not None and layout.cu_seqlens is cu_seqlens else None


def _version(t: torch.Tensor) -> int | None:
    """torch's in-place write counter, or None where there is none (inference tensors)."""
    return None if t.is_inference() else t._version


@dataclasses.dataclass
class _Entry:
    """A CUDA cu_seqlens tensor's offsets as last read, and what says whether they still hold."""
    memory: weakref.ref   # the tensor, or the base it is a view of (an engine's buffer outlives its slices)
    data_ptr: int
    numel: int
    stride: int
    dtype: torch.dtype
    version: int | None
    offsets: tuple[int, ...]

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` is the entry's tensor or another view of the same memory, extent and dtype (engines slice
        their buffers anew each step). The memory cannot be reused while its base is alive, so equal pointers
        mean the same memory; views share one version counter."""
        base = self.memory()
        return (base is not None and t.data_ptr() == self.data_ptr and t.numel() == self.numel
                and t.dtype == self.dtype and t.stride(0) == self.stride and t.device == base.device)


_entries: list[_Entry] = []


def _read_every_call(cu_seqlens: torch.Tensor) -> bool:
    """Whether reading the tensor is free (a host tensor): then its content is the key, never a cache."""
    return not cu_seqlens.is_cuda


def _capturing(cu_seqlens: torch.Tensor) -> bool:
    return cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()


def _cached_offsets(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """The tensor's offsets: from the cache where they still hold, else read now and remembered."""
    _entries[:] = [e for e in _entries if e.memory() is not None]
    capturing = _capturing(cu_seqlens)
    version = _version(cu_seqlens)
    for entry in _entries:
        if not entry.holds(cu_seqlens):
            continue
        # While capturing nothing can be read: the last eager read is used, checked on the device.
        if capturing or (version is not None and entry.version == version):
            return entry.offsets
    if capturing:
        raise RuntimeError("cu_seqlens is new to gdnkit while a CUDA graph is being captured: reading its offsets "
                           "would break the capture. Call once with this same tensor before capturing.")
    offsets = tuple(cu_seqlens.tolist())
    _remember(cu_seqlens, version, offsets)
    return offsets


def _remember(cu_seqlens: torch.Tensor, version: int | None, offsets: tuple[int, ...]) -> None:
    """Keep `offsets` as the CUDA tensor's values at `version`, in place of any older entry of its memory."""
    _entries[:] = [e for e in _entries if not e.holds(cu_seqlens)]
    base = cu_seqlens if cu_seqlens._base is None else cu_seqlens._base
    _entries.append(_Entry(weakref.ref(base), cu_seqlens.data_ptr(), cu_seqlens.numel(),
                           cu_seqlens.stride(0), cu_seqlens.dtype, version, offsets))
    del _entries[:-CACHED_TENSORS]


def host_offsets(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """cu_seqlens on the host: read every call on a CPU, cached per tensor and version on a GPU (module doc)."""
    own = _own_layout(cu_seqlens)
    if own is not None:
        return own.offsets
    if _read_every_call(cu_seqlens):
        return tuple(cu_seqlens.tolist())
    return _cached_offsets(cu_seqlens)


def sequence_layout(cu_seqlens: torch.Tensor) -> SequenceLayout:
    """The layout of a packed batch; the offsets must be valid (gdnkit.problem checks them first).

    Backends launch their kernels with the layout's own cu_seqlens copy, never the caller's tensor, so the
    tables and the offsets the kernels read always agree. For a caller's CUDA tensor a device-side check that it
    still holds the offsets is enqueued (module doc)."""
    own = _own_layout(cu_seqlens)
    if own is not None:
        return own
    if _read_every_call(cu_seqlens):
        return _layout_of(tuple(cu_seqlens.tolist()), cu_seqlens.device)
    layout = _layout_of(_cached_offsets(cu_seqlens), cu_seqlens.device)
    # also right after a read, where it cannot fail: the eager call that read the tensor then builds the check's
    # kernel for it (its dtype and alignment), so a CUDA-graph capture that follows never compiles one
    _assert_offsets_agree(cu_seqlens, layout.cu_seqlens)
    return layout


def _assert_offsets_agree(cu_seqlens: torch.Tensor, own: torch.Tensor) -> None:
    """The device-side check of cached offsets (module doc): one Triton launch where Triton takes the tensor, else
    torch's three (on a host tensor torch._assert_async is a plain assert)."""
    from gdnkit.prologue import triton_reads   # (prologue imports problem, which imports this module)
    if cu_seqlens.is_cuda and triton_reads(cu_seqlens):   # (1-D: problem.check_cu_seqlens)
        from gdnkit.backends.triton_shared.offsets_check import assert_offsets_agree
        assert_offsets_agree(cu_seqlens, own)
    else:
        torch._assert_async((cu_seqlens == own).all())


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
    """(start, end) of every sequence, from the layout (so with sequence_layout's device check)."""
    offsets = sequence_layout(cu_seqlens).offsets
    return list(zip(offsets[:-1], offsets[1:]))


def remember_host_offsets(cu_seqlens: torch.Tensor, host: torch.Tensor | list[int] | tuple[int, ...]) -> None:
    """Take a caller's host copy of cu_seqlens (FLA's cu_seqlens_cpu) instead of reading the CUDA tensor (a sync).

    The copy stands in for a read and is checked like one: every chunked call that uses it enqueues the
    device-side comparison with the tensor (module doc), so a copy that disagrees asserts rather than computing
    with wrong offsets. A CPU tensor is read every call anyway, and nothing is remembered while a CUDA graph is
    being captured. A copy of the wrong length is rejected.
    """
    offsets = tuple(int(x) for x in (host.tolist() if isinstance(host, torch.Tensor) else host))
    if len(offsets) != cu_seqlens.numel():
        raise ValueError(f"cu_seqlens_cpu must hold the {cu_seqlens.numel()} offsets of cu_seqlens, got {len(offsets)}")
    if _read_every_call(cu_seqlens) or _capturing(cu_seqlens):
        return
    version = _version(cu_seqlens)
    if version is not None and any(e.holds(cu_seqlens) and e.version == version for e in _entries):
        return
    _remember(cu_seqlens, version, offsets)
