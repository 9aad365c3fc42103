"""tilelang_sm90's decisions before any kernel runs: supports() and its reasons, the segment rules (context
parallelism, wide, waves), the fused backward's rule and the recompute's programs an SM with their switches, and
the Plan that explain() shows."""

import types

import pytest
import torch
import torch.nn.functional as F

from .helpers import K, V, _hopper, _problem


def test_fused_backward_rule_and_its_switch():
    """Which backward a training call runs on an H200 (132 SMs): the fused kernel where the work reaches
    fused_min_work chunks x value heads and no program (sequence, or segment of the wide route's cut) is much
    longer than the SMs' even share; the staged one elsewhere (points of benchmarks/results/h200/backward-paths.md,
    each on the side that measured faster), and the staged one where the forward kept S0.
    GDNKIT_SM90_FUSED_BACKWARD=1 / 0
    forces one (config.Config.fused_backward); any other value is refused with the variable named."""
    import itertools
    from gdnkit import seqlayout
    from gdnkit.backends.tilelang_sm90 import plan
    from gdnkit.backends.tilelang_sm90.config import Config

    def pays(HV, *lengths, kept=False, cfg=Config()):
        layout = seqlayout.sequence_layout(torch.tensor([0, *itertools.accumulate(lengths)]))
        return plan.fused_pays(layout, HV, 132, cfg, stores_states=kept)
    assert pays(32, 8192)                                                   # 16/32: 1.18x the staged path
    # S0 kept by the forward (keep_states): the staged path reads it; the fused one would recompute it for X
    assert not pays(32, 8192, kept=True)
    assert pays(8, 820, 2829, 3666, 710, 988, 11940, 3347, 8468)            # 4/8: 1.02x
    assert pays(8, 8192)                                                    # 4/8: 1.09x
    assert pays(4, 32768)                                                   # 2/4: 1.18x
    assert not pays(4, 5239, 2953)                                          # 2/4: too little work (0.94x)
    assert not pays(8, 205, 708, 916, 178, 247, 2985, 836, 2117)            # 4/8: one long (0.62x)
    assert not pays(32, 205, 708, 4326, 2953)                               # 16/32: one long program (0.91x)
    # H100: three long documents, the longest program 1.65x the even share: the fused path 1.19x, 480 MiB less
    assert pays(32, 8192, 8192, 4096)
    # where one program per (sequence, head) fills the SMs and the longest sequence bounds it, the training plan
    # cuts the wide route's waves, and the fused path's programs are its 48-chunk segments: these two measured
    # 0.89x / 0.81x the staged path with whole sequences as programs (2.17x / 1.51x the share)
    assert pays(32, 820, 2829, 17304, 11815)
    assert pays(16, 820, 2829, 3666, 710, 988, 11940, 3347, 8468)
    with_waves_off = Config(wide_waves_segment_chunks=(0, 0))
    assert not pays(32, 820, 2829, 17304, 11815, cfg=with_waves_off)
    assert not pays(16, 820, 2829, 3666, 710, 988, 11940, 3347, 8468, cfg=with_waves_off)
    for forced in (True, False):
        cfg = Config(fused_backward=forced)
        assert pays(32, 8192, cfg=cfg) == forced and pays(1, 64, cfg=cfg) == forced
    for value, want in (("1", True), ("0", False), ("auto", None), ("", None)):
        assert Config.from_environment({"GDNKIT_SM90_FUSED_BACKWARD": value}).fused_backward is want
    with pytest.raises(ValueError, match="GDNKIT_SM90_FUSED_BACKWARD"):
        Config.from_environment({"GDNKIT_SM90_FUSED_BACKWARD": "yes"})


def test_recompute_programs_an_sm_and_their_switch():
    """Two programs an SM only for the fused path's recompute at 64 columns (the build that stores X and fits
    twice), GDNKIT_SM90_RECOMPUTE_PER_SM=1 for one, anything else refused by name."""
    from gdnkit.backends.tilelang_sm90.config import Config
    from gdnkit.backends.tilelang_sm90.plan import recompute_per_sm
    cfg = Config(recompute_per_sm=2)
    assert recompute_per_sm(64, True, cfg) == 2
    assert recompute_per_sm(32, True, cfg) == recompute_per_sm(64, False, cfg) == recompute_per_sm(128, False, cfg) == 1
    assert recompute_per_sm(64, True, Config(recompute_per_sm=1)) == 1
    for value in ("1", "2"):
        assert Config.from_environment({"GDNKIT_SM90_RECOMPUTE_PER_SM": value}).recompute_per_sm == int(value)
    with pytest.raises(ValueError, match="GDNKIT_SM90_RECOMPUTE_PER_SM"):
        Config.from_environment({"GDNKIT_SM90_RECOMPUTE_PER_SM": "3"})


def test_supports_says_why_not():
    """CPU: what the backend takes (Hopper, K = V = 128, bf16/fp16 chunked, inference and training) and the
    reason it gives for everything else; auto dispatch prefers it on Hopper."""
    from gdnkit import dispatch
    from gdnkit.backends.tilelang_sm90 import BACKEND
    from gdnkit.problem import RECURRENT_MODE
    m = _hopper()
    assert BACKEND.reasons(_problem(), m) == []
    assert BACKEND.reasons(_problem(dtype=torch.float16, varlen=True, N=3), m) == []
    cases = {"needs compute capability 9.0 (Hopper": BACKEND.reasons(_problem(), _hopper(capability=(10, 0))),
             "tilelang is not importable": BACKEND.reasons(_problem(), _hopper(tilelang=None)),
             "K = V = 128": BACKEND.reasons(_problem(K=64, V=64), m),
             "not bfloat16 or float16": BACKEND.reasons(_problem(dtype=torch.float32), m),
             "recurrent": BACKEND.reasons(_problem(mode=RECURRENT_MODE), m),
             "float32": BACKEND.reasons(_problem(has_initial_state=True, state_dtype=torch.bfloat16), m),
             "CUDA tensors": BACKEND.reasons(_problem(device_type="cpu", device_index=None), m)}
    for needle, reasons in cases.items():
        assert any(needle in r for r in reasons), (needle, reasons)
    assert dispatch.select(_problem(), machine=m)[1].chosen == "tilelang_sm90"
    assert BACKEND.reasons(_problem(needs_grad=True), m) == []
    assert dispatch.select(_problem(needs_grad=True), machine=m)[1].chosen == "tilelang_sm90"


@pytest.mark.parametrize("H,HV,lengths,expected", [
    (2, 8, [32768], 64),        # 8 segments: 64 (segment, head) pairs, 128 output programs for 132 SMs
    (2, 8, [8192], 32),         # the shortest segment allowed: 4 segments
    (2, 8, [2048], None),       # 32 chunks: one segment would be the whole sequence
    (2, 8, [512], None),        # one segment would be the whole sequence
    (4, 16, [32768], 128),      # 64 narrowest programs: 4 segments (0.905 -> 0.757 ms)
    (8, 32, [32768], 256),      # 128 narrowest programs: 2 segments, by lead-in only
    (16, 64, [32768], None),    # 4 V tiles x 64 heads > 132: enough programs already
    (2, 8, [4096] * 8, None),
])
def test_context_parallel_segment_rule(H, HV, lengths, expected):
    from gdnkit import seqlayout
    from gdnkit.backends.tilelang_sm90 import plan
    from gdnkit.backends.tilelang_sm90.config import Config
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    layout = seqlayout.sequence_layout(cu)
    assert plan.segment_chunks(layout, HV, 132, Config()) == expected
    # the exact route (propagator + scan) pays only from 2 SMs per narrowest program (8/32: 1.51 vs 1.03 ms)
    assert plan.exact_route_pays(layout, HV, 132, Config()) == (4 * len(lengths) * HV * 2 <= 132)


def test_plan_in_explain():
    """The backend's plan as explain() shows it, from the layout, the heads and the SM count alone (a machine
    given as data; no GPU, no kernel): 2/8 with one sequence of 32768 tokens on 132 SMs takes the wide route in
    16 segments of 32 chunks, its backward the fused kernel in those segments (4096 chunks x heads, each program
    32 chunks, within 2.0x the SMs' even share of 31), the staged path where the Config says so."""
    from gdnkit.backends.tilelang_sm90 import BACKEND, config
    from gdnkit.dispatch import Decision
    from gdnkit.dispatch.machine import GPU, Machine
    from gdnkit.problem import CHUNK_MODE, validate_inputs
    machine = Machine(gpus=(GPU(0, "H200", (9, 0), 132, 0),), packages={"triton": "3", "tilelang": "0"})
    T, H, HV = 32768, 2, 8
    q, k = torch.randn(1, T, H, K, dtype=torch.bfloat16), torch.randn(1, T, H, K, dtype=torch.bfloat16)
    v = torch.randn(1, T, HV, V, dtype=torch.bfloat16)
    g, beta = F.logsigmoid(torch.randn(1, T, HV)), torch.rand(1, T, HV)
    problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta)
    text = BACKEND.plan(problem, inputs, machine)
    assert text.splitlines()[0] == "route: wide, 16 segments of 32 chunks (132 SMs)", text
    assert "backward" not in text   # inference
    problem, inputs = validate_inputs(CHUNK_MODE, q, k, v.requires_grad_(), g, beta)
    assert "backward: fused (backward_fused.py), in the wide route's 16 segments" in BACKEND.plan(problem, inputs,
                                                                                                 machine)
    with config.configured(fused_backward=False):
        text = BACKEND.plan(problem, inputs, machine)
    assert "backward: staged, reverse pass chained" in text, text
    shown = str(Decision(problem, "tilelang_sm90", "auto", {}, plan=text))
    assert shown.endswith("plan:\n" + "\n".join("  " + line for line in text.splitlines())), shown


@pytest.mark.parametrize("H,HV,lengths,expected", [
    (2, 8, [32768], 32),        # 16 segments x 8 heads: 128 programs of 128 columns for 132 SMs
    (4, 16, [32768], 64),
    (8, 32, [32768], 128),
    (16, 64, [32768], 256),     # 2 segments
    (2, 8, [4096] * 8, 32),     # 64 sequence-head pairs: each sequence in 2
    (2, 8, [8192], 8),          # 16 segments of 8 chunks
    (2, 8, [2048], 2),          # short sequences too, down to 2-chunk segments (wide_min_segment_chunks)
    (4, 16, [2048], 4),
    (8, 32, [2048], 8),
    (16, 64, [2048], None),     # 128 programs of the 64-column pass fill the SMs already: long segments only
    (16, 64, [4096], 32),
    (2, 8, [128], None),        # 2 chunks: one segment would be the whole sequence
    (2, 8, [2048] * 4, 8),      # 32 pairs: 4 segments each
    (4, 16, [4096] * 8, None),  # 128 pairs already fill 70% of the SMs: the wide pass without segments
    (16, 64, [4096] * 8, None),
    # unequal sequences cut at one length: each program as long as an equal split's
    (2, 8, [28672, 4096], 32),  # 14 + 2 segments x 8 heads, as 1x32768's 16
    (8, 24, [28672, 4096], 112),  # 4 + 1 segments x 24 heads: 120 programs
    (2, 8, [1024, 7168], 8),    # 2 + 14 segments
    (4, 16, [12288, 4096], 32),
])
def test_wide_segment_rule(H, HV, lengths, expected):
    """Inference's wide route cuts segments so one 128-column program per (segment, head) fills the SMs."""
    from gdnkit import seqlayout
    from gdnkit.backends.tilelang_sm90 import plan
    from gdnkit.backends.tilelang_sm90.config import Config
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    layout = seqlayout.sequence_layout(cu)
    assert plan.wide_segment_chunks(layout, HV, 132, Config()) == expected
    assert plan.wide_segment_chunks(layout, HV, 0, Config()) is None   # off CUDA
    # forced segments keep the other routes
    assert plan.wide_segment_chunks(layout, HV, 132, Config(segment_chunks=16)) is None


@pytest.mark.parametrize("H,HV,lengths,expected", [
    (16, 48, [28672, 4096], (64, 3)),   # 96 pairs fill the SMs, the long sequence dominates: 384 programs
    (16, 48, [4096, 28672], (64, 3)),
    (16, 64, [28672, 4096], (64, 4)),
    (16, 64, [24576, 8192], (128, 2)),  # 2 x 130 steps against 384
    (16, 48, [16384] * 2, (64, 3)),     # 198 steps against 256
    (16, 64, [16384] * 2, None),        # 264 against 256: the plain pass
    (16, 64, [4096] * 8, None),         # the total work, not one sequence, bounds the plain pass
    (2, 8, [32768], None),              # 8 pairs: the one-wave rule's (wide_segment_chunks)
    (16, 64, [2048, 128], None),        # no cut of at least 32 chunks pays
])
def test_wide_waves_segment_rule(H, HV, lengths, expected):
    """Where one program per (sequence, head) fills the SMs already, the wide route still cuts segments, in
    several waves, when the longest sequence bounds the plain pass and the waves cost at most waves_margin of
    it; the forward takes it only where the one-wave rule declines."""
    from gdnkit import seqlayout
    from gdnkit.backends.tilelang_sm90 import plan
    from gdnkit.backends.tilelang_sm90.config import Config
    layout = seqlayout.sequence_layout(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]))
    assert plan.wide_waves_segment_chunks(layout, HV, 132, Config()) == expected
    if expected:
        assert plan.wide_segment_chunks(layout, HV, 132, Config()) is None
    assert plan.wide_waves_segment_chunks(layout, HV, 0, Config()) is None   # off CUDA
    # forced segments keep the other routes
    assert plan.wide_waves_segment_chunks(layout, HV, 132, Config(segment_chunks=16)) is None



@pytest.mark.parametrize("kept", [False, True], ids=["default", "keep_states"])
def test_training_takes_the_waves(kept):
    """A training call at packed documents where the longest sequence bounds one program per (sequence, head)
    (8/32 and 16/32 at 8192 + 8192 + 4096 tokens on 132 SMs) plans the wide route's waves as inference does: 48-chunk
    segments in two waves, the pass over sequences beside them at 128 columns (64 where the forward keeps S0, which
    the 128-column kernel cannot store), and the backward in the same segments: the fused path's programs, else the
    staged path's chained route."""
    from gdnkit import seqlayout
    from gdnkit.backends.tilelang_sm90 import plan
    from gdnkit.backends.tilelang_sm90.config import Config
    layout = seqlayout.sequence_layout(torch.tensor([0, 8192, 16384, 20480]))
    for train in (False, True):
        p = plan.plan(types.SimpleNamespace(HV=32, needs_grad=train), layout, plan.Resources(132), Config(keep_states=kept))
        assert (p.route, p.segment_chunks, p.waves, p.n_segments) == ("waves", 48, 2, 8), p.describe()
        assert p.launches == (8, 3) and p.plain_block_v == (64 if kept and train else 128)
        if train:
            assert p.fused_backward != kept and p.backward_route == "chained"
            assert p.fused_segment_chunks == 48
            assert ("fused (backward_fused.py), in the wide route's 8 segments" in p.describe()) != kept
    # with the waves forced off the training plan keeps whole sequences (the fused kernel's longest program 128
    # chunks)
    p = plan.plan(types.SimpleNamespace(HV=32, needs_grad=True), layout, plan.Resources(132), Config(wide_waves_segment_chunks=(0, 0)))
    assert p.route == "plain" and p.fused_segment_chunks is None

def test_plans_are_kept_per_layout_heads_training_machine_and_config():
    """An eager loop plans once per layout: the same inputs give the very same Plan, and any input that changes a
    decision (offsets, heads, training, the machine, the Config) gives its own."""
    import dataclasses

    import torch

    from gdnkit import seqlayout
    from gdnkit.backends.tilelang_sm90 import config, plan

    layout = seqlayout.sequence_layout(torch.tensor([0, 4096, 4160]))
    other = seqlayout.sequence_layout(torch.tensor([0, 64, 4160]))
    problem = _problem(T=4160, H=2, HV=8, N=2, varlen=True)
    res, cfg = plan.Resources(132), config.current()
    first = plan.plan(problem, layout, res, cfg)
    assert plan.plan(problem, layout, res, cfg) is first
    assert first == plan._plan(layout, 8, False, res, cfg)   # what planning afresh gives
    changed = [plan.plan(problem, other, res, cfg),
               plan.plan(dataclasses.replace(problem, HV=16), layout, res, cfg),
               plan.plan(dataclasses.replace(problem, needs_grad=True), layout, res, cfg),
               plan.plan(problem, layout, plan.Resources(16), cfg),
               plan.plan(problem, layout, res, dataclasses.replace(cfg, segment_chunks=4))]
    for p, fresh in zip(changed, [plan._plan(other, 8, False, res, cfg), plan._plan(layout, 16, False, res, cfg),
                                  plan._plan(layout, 8, True, res, cfg), plan._plan(layout, 8, False,
                                                                                   plan.Resources(16), cfg),
                                  plan._plan(layout, 8, False, res, dataclasses.replace(cfg, segment_chunks=4))]):
        assert p == fresh and p is not first
