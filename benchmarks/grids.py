"""The grids of problems the harness measures: `tiny` (CPU), `quick` (one cold H200 run) and `full`.

A grid point is one (pass, heads, sequence mix); every implementation runs every point it supports.
Points of one head config sit next to each other so a TileLang anchor compiles its kernels for that
(H, HV) once and reuses them for the next sequence mix.
"""
from __future__ import annotations

import dataclasses
import random

PASSES = ("fwd", "bwd", "decode", "mtp")
# passes over a batch of B sequences with a state each (B set on their points): decode (one new token a sequence)
# and mtp (a speculative verify of T draft tokens a sequence, every token's state kept)
STATE_PASSES = ("decode", "mtp")
MTP_TOKENS = 4   # draft tokens a sequence in the mtp points (the T of MTP T=4)


def parse_heads(text: str) -> list[tuple[int, int]]:
    """"4x8,16x32" -> [(4, 8), (16, 32)]: the H x HV pairs every command of the harness and its studies takes."""
    heads = []
    for token in text.split(","):
        H, _, HV = token.strip().lower().partition("x")
        heads.append((int(H), int(HV)))
    return heads


def seqlens_label(seqlens: tuple[int, ...]) -> str:
    """Sequence mixes named as FlashQLA's published table names them: "1x32768" is one
    sequence of 32768 tokens, "4096x8" is eight sequences of 4096 (length x count), and unequal
    lengths read "28672+4096"."""
    if len(seqlens) == 1:
        return f"1x{seqlens[0]}"
    if len(set(seqlens)) == 1:
        return f"{seqlens[0]}x{len(seqlens)}"
    return "+".join(map(str, seqlens))


@dataclasses.dataclass(frozen=True)
class Point:
    """One problem. For decode, `seqlens` is B ones (one new token per sequence) and B is set; for mtp, B times
    the draft tokens a sequence."""

    pass_: str  # "fwd" | "bwd" | "decode" | "mtp"
    H: int  # q/k heads
    HV: int  # value heads
    seqlens: tuple[int, ...]
    B: int | None = None  # decode batch; None for fwd/bwd (sequences are packed, B = 1)
    K: int = 128
    V: int = 128

    @property
    def label(self) -> str:
        return seqlens_label(self.seqlens)

    @property
    def tokens(self) -> int:
        return sum(self.seqlens)

    @property
    def key(self) -> tuple:
        """What identifies a row of latest.json, without the implementation."""
        return (self.pass_, self.H, self.HV, self.label, self.B)

    def describe(self) -> str:
        if self.pass_ == "decode":
            return f"decode B={self.B} H={self.H} HV={self.HV}"
        if self.pass_ == "mtp":
            return f"mtp B={self.B} T={self.seqlens[0]} H={self.H} HV={self.HV}"
        return f"{self.pass_} H={self.H} HV={self.HV} {self.label}"


@dataclasses.dataclass(frozen=True)
class Grid:
    name: str
    points: tuple[Point, ...]
    # Per head config, the small problem every implementation is checked on against the float64
    # reference: several sequences of odd lengths, so chunk tails and sequence starts are exercised.
    accuracy_seqlens: tuple[int, ...]
    accuracy_decode_B: int

    def select(self, passes=None, heads=None, mixes=None) -> "Grid":
        """The same grid restricted to some passes, (H, HV) head configs and/or sequence mixes (labels as
        seqlens_label writes them, e.g. "28672+4096"), the passes in the order given (so a run under a time
        budget measures the passes it names first)."""
        keep = [p for p in self.points
                if (passes is None or p.pass_ in passes) and (heads is None or (p.H, p.HV) in heads)
                and (mixes is None or p.label in mixes)]
        if passes is not None:
            order = list(passes)
            keep.sort(key=lambda p: order.index(p.pass_))  # stable: head configs stay together
        return dataclasses.replace(self, points=tuple(keep))

    def head_configs(self, pass_: str) -> list[tuple[int, int]]:
        seen: list[tuple[int, int]] = []
        for p in self.points:
            if p.pass_ == pass_ and (p.H, p.HV) not in seen:
                seen.append((p.H, p.HV))
        return seen


def _chunk_points(pass_: str, heads, mixes, K=128, V=128) -> list[Point]:
    return [Point(pass_, H, HV, tuple(mix), K=K, V=V) for H, HV in heads for mix in mixes]


def _decode_points(configs, K=128, V=128) -> list[Point]:
    return [Point("decode", H, HV, (1,) * B, B=B, K=K, V=V) for B, H, HV in configs]


def _mtp_points(configs, T=MTP_TOKENS, K=128, V=128) -> list[Point]:
    return [Point("mtp", H, HV, (T,) * B, B=B, K=K, V=V) for B, H, HV in configs]


def random_split(total: int, n: int, seed: int = 42) -> list[int]:
    """`n` positive lengths summing to `total`, cut at random points (reproducible by seed)."""
    if n <= 1:
        return [total]
    cuts = sorted(random.Random(seed).sample(range(1, total), n - 1))
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


# quick: the points of FlashQLA's published anchor table, small enough for one cold 10-minute GPU
# run per pass group (FlashQLA's TileLang forward compiles ~60-80 s per (H, HV), backward ~4 min).
QUICK_FWD_HEADS = ((2, 8), (4, 16), (8, 32), (16, 64))
QUICK_FWD_MIXES = ([32768], [2048], [4096] * 8)
QUICK_BWD_MIXES = ([8192], [32768])
# training batches of several long sequences (packed documents), where a backward's programs per sequence and
# its segments meet sequence boundaries: at 8/32 and 16/32, the head configs of Qwen3.5-class models
QUICK_BWD_VARLEN_MIXES = ([8192, 8192, 4096], [4096] * 4)
QUICK_BWD = (((4, 8), QUICK_BWD_MIXES), ((8, 32), QUICK_BWD_VARLEN_MIXES),
             ((16, 32), QUICK_BWD_MIXES + QUICK_BWD_VARLEN_MIXES))
QUICK_DECODE = ((1, 16, 64), (64, 16, 64), (256, 2, 8), (256, 16, 32))  # (B, H, HV)
QUICK_MTP = ((64, 16, 64), (256, 16, 32), (256, 2, 8))  # (B, H, HV), MTP_TOKENS draft tokens each

# full: FlashQLA's published H200 grid (value/key heads as (H, HV) here) plus a wider decode sweep.
FULL_FWD_HEADS = ((2, 8), (4, 16), (8, 32), (16, 64), (16, 32), (8, 24), (16, 48), (16, 16), (32, 32))
FULL_FWD_MIXES = (
    [32768], [16384], [8192], [4096], [2048],
    [28672, 4096], [24576, 8192], [16384, 16384], [8192, 24576], [4096, 28672],
    [12288, 4096], [6144, 2048], [4096, 4096], [2048, 6144], [1024, 7168],
    [8192] * 4, [4096] * 8, [2048] * 4, [1024] * 8,
)
FULL_BWD_HEADS = ((16, 32), (8, 16), (4, 8), (2, 4))
# 8k and 32k tokens split into 1, 2, 4, 8 sequences at random (fixed seed) cut points.
FULL_BWD_MIXES = tuple(random_split(total, n) for total in (8192, 32768) for n in (1, 2, 4, 8))
FULL_DECODE = tuple((B, H, HV) for H, HV in ((2, 8), (4, 16), (16, 32), (16, 64)) for B in (1, 8, 64, 256))

# tiny: CPU-sized, so the harness runs end to end on the reference backend in seconds.
TINY_K = TINY_V = 16


def _grid(name: str) -> Grid:
    if name == "quick":
        pts = (_chunk_points("fwd", QUICK_FWD_HEADS, QUICK_FWD_MIXES)
               + [p for heads, mixes in QUICK_BWD for p in _chunk_points("bwd", (heads,), mixes)]
               + _decode_points(QUICK_DECODE) + _mtp_points(QUICK_MTP))
        return Grid("quick", tuple(pts), accuracy_seqlens=(1, 64, 135, 133), accuracy_decode_B=3)
    if name == "full":
        pts = (_chunk_points("fwd", FULL_FWD_HEADS, FULL_FWD_MIXES)
               + _chunk_points("bwd", FULL_BWD_HEADS, FULL_BWD_MIXES) + _decode_points(FULL_DECODE))
        return Grid("full", tuple(pts), accuracy_seqlens=(1, 64, 135, 133), accuracy_decode_B=3)
    if name == "tiny":
        pts = (_chunk_points("fwd", ((1, 2), (2, 4)), ([64], [5, 27, 1]), K=TINY_K, V=TINY_V)
               + _chunk_points("bwd", ((1, 2),), ([24],), K=TINY_K, V=TINY_V)
               + _decode_points(((2, 1, 2), (3, 2, 4)), K=TINY_K, V=TINY_V)
               + _mtp_points(((2, 1, 2),), T=3, K=TINY_K, V=TINY_V))
        return Grid("tiny", tuple(pts), accuracy_seqlens=(1, 17, 22), accuracy_decode_B=2)
    raise ValueError(f"unknown grid {name!r}; choose one of {', '.join(GRIDS)}")


GRIDS = ("tiny", "quick", "full")


def get_grid(name: str) -> Grid:
    return _grid(name)
