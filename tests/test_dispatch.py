"""Dispatch: overrides, errors, explain(), logging, and which backend each GPU generation gets."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import gdnkit
from gdnkit import dispatch
from gdnkit.dispatch import registry
from gdnkit.problem import CHUNK_MODE, Problem

from conftest import make_inputs

GENERATIONS = {  # name -> (compute capability, a GPU of that generation)
    "ampere_sm80": ((8, 0), "NVIDIA A100-SXM4-80GB"),
    "ampere_sm86": ((8, 6), "NVIDIA GeForce RTX 3090"),
    "ada_sm89": ((8, 9), "NVIDIA L40S"),
    "hopper_sm90": ((9, 0), "NVIDIA H200"),
    "blackwell_sm100": ((10, 0), "NVIDIA B200"),
    "blackwell_sm120": ((12, 0), "NVIDIA GeForce RTX 5090"),
}
PACKAGE_SETS = {
    "none": {"triton": None, "tilelang": None},
    "triton": {"triton": "3.6.0", "tilelang": None},
    "triton+tilelang": {"triton": "3.6.0", "tilelang": "0.1.15"},
}

# Which backend auto must pick, per (machine, installed compilers, problem). Pinned by hand: a change
# to selection logic or a backend's supports() that strands a generation shows up here. Every CUDA GPU
# of compute capability 8.0+ with triton gets triton_generic, training included; without triton, and on a
# CPU, the reference runs. On Hopper with tilelang, inference and training go to tilelang_sm90.
_BY_GENERATION = {  # the backend with: no compiler package, triton, triton + tilelang (PACKAGE_SETS' order)
    "ampere_sm80": ("reference", "triton_generic", "triton_generic"),
    "ampere_sm86": ("reference", "triton_generic", "triton_generic"),
    "ada_sm89": ("reference", "triton_generic", "triton_generic"),
    "hopper_sm90": ("reference", "triton_generic", "tilelang_sm90"),
    "blackwell_sm100": ("reference", "triton_generic", "triton_generic"),
    "blackwell_sm120": ("reference", "triton_generic", "triton_generic"),
    "cpu": ("reference", "reference", "reference"),
}
_BY_MACHINE = {(gen, pkgs): row[i] for gen, row in _BY_GENERATION.items() for i, pkgs in enumerate(PACKAGE_SETS)}
EXPECTED = {**{(gen, pkgs, "inference"): backend for (gen, pkgs), backend in _BY_MACHINE.items()},
            # training goes where inference does (tilelang_sm90 has its backward on Hopper)
            **{(gen, pkgs, "training"): backend for (gen, pkgs), backend in _BY_MACHINE.items()}}


def fake_machine(gen: str, pkgs: str) -> dispatch.Machine:
    gpus = ()
    if gen != "cpu":
        cc, name = GENERATIONS[gen]
        gpus = (dispatch.GPU(index=0, name=name, capability=cc, sm_count=132, total_memory_bytes=80 << 30),)
    packages = PACKAGE_SETS[pkgs]
    return dispatch.Machine(gpus=gpus, torch_cuda_version="12.8" if gpus else None,
                            cuda_driver_version="12.8" if gpus else None, packages=dict(packages),
                            import_errors={n: "ModuleNotFoundError" for n, v in packages.items() if v is None})


def problem(device_type="cuda", dtype=torch.bfloat16, needs_grad=False, K=128, **over) -> Problem:
    fields = dict(mode=CHUNK_MODE, B=1, T=4096, H=4, HV=16, K=K, V=K, N=1, dtype=dtype, gate_dtype=torch.float32,
                  device_type=device_type, device_index=0 if device_type == "cuda" else None, scale=K ** -0.5,
                  varlen=False, has_initial_state=False, state_dtype=None, output_final_state=False,
                  needs_grad=needs_grad)
    fields.update(over)
    return Problem(**fields)


@pytest.mark.parametrize("key", sorted(EXPECTED), ids=lambda k: "-".join(k))
def test_auto_choice_per_gpu_generation(key):
    gen, pkgs, kind = key
    with dispatch.use_machine(fake_machine(gen, pkgs)):
        p = problem(device_type="cpu" if gen == "cpu" else "cuda", needs_grad=kind == "training")
        chosen, decision = dispatch.select(p)
    assert chosen.name == EXPECTED[key]
    assert decision.source == "auto"


def test_pre_ampere_gpu_falls_back_to_reference_with_a_reason():
    volta = dataclasses.replace(fake_machine("ampere_sm80", "triton"), gpus=(
        dispatch.GPU(index=0, name="Tesla V100", capability=(7, 0), sm_count=80, total_memory_bytes=32 << 30),))
    with dispatch.use_machine(volta):
        chosen, decision = dispatch.select(problem())
    assert chosen.name == "reference"
    assert any("compute capability >= 8.0" in r for r in decision.reasons["triton_generic"])


@pytest.mark.parametrize("gen", list(GENERATIONS))
def test_cpu_tensors_and_float64_go_to_reference(gen):
    with dispatch.use_machine(fake_machine(gen, "triton+tilelang")):
        assert dispatch.select(problem(device_type="cpu"))[0].name == "reference"
        assert dispatch.select(problem(dtype=torch.float64))[0].name == "reference"


class Declining(dispatch.Backend):
    """A backend that runs nowhere: stands in for a fast backend that can't take the problem."""

    name, priority, description = "declining", 1000, "test backend"

    def supports(self, problem, machine):
        return [f"declines everything (asked for {problem.dtype})"]

    chunk_forward = chunk_backward = recurrent_forward = recurrent_backward = None


@pytest.fixture
def declining(monkeypatch):
    backend = Declining()
    monkeypatch.setitem(registry._registry, backend.name, backend)
    return backend


def test_auto_skips_a_backend_with_reasons_and_explain_lists_them(declining):
    x = make_inputs(1, 8, 1, 1, 4, 4)
    decision = gdnkit.explain(**x)
    assert decision.chosen == "reference" and decision.source == "auto"
    assert decision.reasons["declining"] == ["declines everything (asked for torch.float64)"]
    text = str(decision)
    assert "chosen: reference (by auto)" in text and "declining: declines everything" in text


def test_forced_backend_that_cannot_run_lists_its_reasons(declining):
    x = make_inputs(1, 8, 1, 1, 4, 4)
    with pytest.raises(dispatch.BackendNotSupportedError, match=r"backend='declining' cannot run chunk B=1 T=8"
                       r"[\s\S]*- declines everything"):
        gdnkit.chunk_gated_delta_rule(**x, backend="declining")


def test_env_override_and_argument_precedence(monkeypatch, declining):
    x = make_inputs(1, 8, 1, 1, 4, 4)
    monkeypatch.setenv(dispatch.ENV_VAR, "declining")
    with pytest.raises(dispatch.BackendNotSupportedError, match="GDNKIT_BACKEND='declining' cannot run"):
        gdnkit.chunk_gated_delta_rule(**x)
    assert gdnkit.explain(**x, backend="reference").source == "argument"  # the argument wins
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    assert gdnkit.explain(**x).source == "environment"
    monkeypatch.setenv(dispatch.ENV_VAR, "auto")
    assert gdnkit.explain(**x).source == "auto"


def test_unknown_name_lists_valid_names(monkeypatch):
    x = make_inputs(1, 8, 1, 1, 4, 4)
    with pytest.raises(ValueError, match=r"unknown backend backend='nope'; valid names: auto, .*reference"):
        gdnkit.chunk_gated_delta_rule(**x, backend="nope")
    monkeypatch.setenv(dispatch.ENV_VAR, "typo")
    with pytest.raises(ValueError, match=r"unknown backend GDNKIT_BACKEND='typo'"):
        gdnkit.fused_recurrent_gated_delta_rule(**x)


def test_a_repeated_problem_is_decided_once(monkeypatch):
    """An eager loop repeats its problem: the second decision is the first, no backend asked again; another
    problem, another name asked for (argument or environment) or an injected machine decide afresh."""
    import importlib
    monkeypatch.setattr(importlib.import_module("gdnkit.dispatch.select"), "_DECIDED", {})
    asked = []
    real = dispatch.Backend.reasons
    monkeypatch.setattr(dispatch.Backend, "reasons", lambda self, p, m: asked.append(self.name) or real(self, p, m))
    p = problem(device_type="cpu")
    first = dispatch.decide(p)
    n = len(asked)
    assert n == len(registry.backends()) and first.chosen == "reference"
    assert dispatch.decide(p) is first and dispatch.select(p)[1] is first and len(asked) == n
    assert dispatch.decide(dataclasses.replace(p, T=p.T + 1)) == dataclasses.replace(
        first, problem=dataclasses.replace(p, T=p.T + 1)) and len(asked) == 2 * n
    assert dispatch.decide(p, backend="reference").source == "argument" and len(asked) == 3 * n
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    assert dispatch.decide(p).source == "environment"
    monkeypatch.delenv(dispatch.ENV_VAR)
    before = len(asked)
    with dispatch.use_machine(fake_machine("hopper_sm90", "none")):
        dispatch.decide(p)
        dispatch.decide(p)
    assert len(asked) == before + 2 * n
    assert dispatch.decide(p) is first


def test_no_backend_at_all_is_one_error_listing_everyone(monkeypatch, declining):
    ref = registry.get("reference")
    monkeypatch.setattr(ref, "supports", lambda p, m: ["switched off for this test"])
    with pytest.raises(dispatch.BackendNotSupportedError, match=r"no backend can run[\s\S]*declining: declines"
                       r"[\s\S]*reference: switched off"):
        dispatch.select(problem(device_type="cpu"))


def test_each_decision_is_logged_at_debug(caplog):
    x = make_inputs(1, 8, 1, 1, 4, 4)
    with caplog.at_level(logging.DEBUG, logger="gdnkit"):
        gdnkit.chunk_gated_delta_rule(**x)
    assert any("chosen: reference (by auto)" in r.getMessage() for r in caplog.records)


def test_injected_machine_is_restored_and_probe_is_cached():
    real = dispatch.machine()
    with dispatch.use_machine(fake_machine("hopper_sm90", "none")) as fake:
        assert dispatch.machine() is fake
    assert dispatch.machine() is real is dispatch.machine()


def test_probe_on_this_machine_reports_what_it_found():
    m = dispatch.probe_machine()
    assert m.torch_version == torch.__version__
    assert set(m.packages) == {"triton", "tilelang"}
    for name, version in m.packages.items():
        assert (version is None) == (name in m.import_errors)
    if not torch.cuda.is_available():
        assert m.gpus == () and m.cuda_driver_version is None and m.cuda_driver_error
    assert dataclasses.asdict(m) == m.to_dict()


def test_available_backends_includes_reference():
    assert "reference" in gdnkit.available_backends()


_CPU_CALL = """
import sys, torch
import torch.nn.functional as F
import gdnkit
r = torch.randn
q, k = r(1, 9, 2, 16), F.normalize(r(1, 9, 2, 16), dim=-1)
v, g, beta = r(1, 9, 4, 16), F.logsigmoid(r(1, 9, 4)), torch.rand(1, 9, 4)
gdnkit.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
gdnkit.fused_recurrent_gated_delta_rule(q, k, v, g, beta)
import gdnkit.distributed  # the context-parallel call imports nothing more
print(gdnkit.explain(q, k, v, g, beta).chosen, dict(gdnkit.dispatch.machine().packages))
print(sorted({m for m in sys.modules} & {"triton", "tilelang", "torch._dynamo"}))
"""


def test_import_and_cpu_call_import_no_gpu_compiler():
    """The probe finds triton/tilelang by their metadata; a CPU call never imports them, nor torch._dynamo (which
    imports triton itself, and costs seconds): gdnkit marks its calls opaque to Dynamo only once Dynamo is loaded."""
    import os
    import subprocess
    import sys

    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}  # a user's CPU machine: no interpreter
    out = subprocess.run([sys.executable, "-c", _CPU_CALL], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    chosen, imported = out.stdout.strip().splitlines()[-2:]
    assert chosen.startswith("reference")
    assert eval(imported) == [], out.stdout


def test_probe_reports_a_missing_package_without_importing(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tilelang" else real(name, *a))
    m = dispatch.probe_machine()
    assert m.packages["tilelang"] is None and m.import_errors["tilelang"] == "not installed"
    with dispatch.use_machine(m):
        reasons = gdnkit.explain(**make_inputs(dtype=torch.float32)).reasons["tilelang_sm90"]
    assert "tilelang is not importable (not installed)" in reasons


def test_explain_with_a_forced_backend_explains_instead_of_raising():
    x = make_inputs(dtype=torch.float32)
    with dispatch.use_machine(fake_machine("ada_sm89", "triton")):
        decision = gdnkit.explain(**x, backend="tilelang_sm90")
        with pytest.raises(gdnkit.BackendNotSupportedError):
            gdnkit.chunk_gated_delta_rule(**x, backend="tilelang_sm90")
    assert decision.chosen == "tilelang_sm90" and not decision.runs and decision.source == "argument"
    text = str(decision)
    assert "tilelang_sm90 (by argument), which cannot take this problem" in text
    assert "tilelang is not importable" in text and "reference: could run\n" in text + "\n"
    ok = gdnkit.explain(**x, backend="reference")
    assert ok.runs and ok.chosen == "reference"
    with pytest.raises(ValueError, match="unknown backend backend='nope'"):
        gdnkit.explain(**x, backend="nope")


def test_explain_names_itself_for_an_unknown_keyword():
    x = make_inputs(dtype=torch.float32)
    with pytest.raises(TypeError, match=r"^explain\(\) got an unexpected keyword argument 'use_qk_l2norm'.*"
                                        r"use_qk_l2norm_in_kernel"):
        gdnkit.explain(**x, use_qk_l2norm=True)
    with pytest.raises(TypeError, match="explain.*'num_accepted_tokens'"):
        gdnkit.explain(**x, num_accepted_tokens=torch.ones(1, dtype=torch.int32))   # a recurrent-only argument
    pool = x.pop("initial_state")
    decision = gdnkit.explain(**x, initial_state=pool, mode="recurrent",
                              ssm_state_indices=torch.zeros(1, dtype=torch.int32))
    assert decision.runs and decision.problem.serving


# ---- short sequences: the chunked call in the token-by-token form -----------------------------------------------

def _offsets(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


@pytest.mark.parametrize("lengths, short", [
    ([8] * 4096, True),                       # the many-short-sequence prefill
    ([1, 16, 3, 0], True),                    # empty and one-token sequences among short ones
    ([16] * 10 + [17], False),                # one sequence one token past the bound
    ([1] * 100 + [1000], False),              # short mean, one long sequence
    ([0, 0], False),                          # no tokens: nothing to walk
])
def test_short_sequences_rule(lengths, short):
    bound = dispatch.SHORT_SEQUENCE
    assert bound == 16
    p = problem(T=sum(lengths), N=len(lengths), varlen=True)
    assert dispatch.short_sequences(p, _offsets(lengths)) is short
    # only for a GPU inference call without a state pool
    assert not dispatch.short_sequences(dataclasses.replace(p, needs_grad=True), _offsets(lengths))
    assert not dispatch.short_sequences(dataclasses.replace(p, device_type="cpu", device_index=None),
                                        _offsets(lengths))
    # a dense [B, T] batch: its T
    assert dispatch.short_sequences(problem(B=64, T=bound), None)
    assert not dispatch.short_sequences(problem(B=64, T=bound + 1), None)


@pytest.mark.parametrize("gen", ["hopper_sm90", "ampere_sm80"])
def test_auto_runs_short_sequences_token_by_token(gen):
    """Auto dispatch gives a short-sequence inference call the recurrent form on the backend that runs it fast
    (explain says so); a forced backend, the reference and a long call keep the chunked form."""
    p = problem(T=8 * 512, N=512, varlen=True)
    with dispatch.use_machine(fake_machine(gen, "triton+tilelang")):
        chosen, decision = dispatch.select(p, short=True)
        assert chosen.name == "triton_generic" and decision.problem.mode == "recurrent"
        assert "token by token" in str(decision)
        assert dataclasses.replace(decision.problem, mode=CHUNK_MODE) == p   # nothing else changed
        forced, kept = dispatch.select(p, backend="triton_generic", short=True)
        assert kept.problem.mode == CHUNK_MODE
        long_call, kept = dispatch.select(p, short=False)
        assert kept.problem.mode == CHUNK_MODE and long_call.name == EXPECTED[(gen, "triton+tilelang", "inference")]
    with dispatch.use_machine(fake_machine(gen, "none")):   # only the reference could: the chunked form stays
        _, kept = dispatch.select(p, short=True)
        assert kept.chosen == "reference" and kept.problem.mode == CHUNK_MODE
