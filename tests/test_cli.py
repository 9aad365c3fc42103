"""The command line a user runs first: info and check, as subprocesses (as a user would)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gdnkit.__main__ import main


def run(*args):
    return subprocess.run([sys.executable, "-m", "gdnkit", *args], capture_output=True, text=True, timeout=300)


def test_info_lists_machine_and_backends():
    out = run("info")
    assert out.returncode == 0, out.stderr
    assert "torch" in out.stdout and "CUDA driver:" in out.stdout
    assert "reference" in out.stdout and "available" in out.stdout


def test_check_gives_a_verdict_and_writes_json(tmp_path):
    path = tmp_path / "report.json"
    out = run("check", "--json", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.rstrip().splitlines()
    assert lines[-1] == "PASS" and "error" in lines[1] and "tol" in lines[1] and "reference" in out.stdout
    report = json.loads(path.read_text())
    assert report["machine"]["torch_version"] and report["verdict"]["pass"]
    assert {r["backend"] for r in report["rows"]} >= {"reference"}
    compared = run("check", "--compare", str(path), str(path))
    assert compared.returncode == 0 and compared.stdout.rstrip().endswith("A: PASS   B: PASS"), compared.stdout


# The argument errors below run main() in this process: a Python start importing torch per case costs more than
# the checks themselves (the two tests above start the command as a user does).
def test_check_rejects_an_unknown_backend(capsys):
    assert main(["check", "--backends", "reference,nope"]) == 2
    assert "--backends: unknown backend 'nope'" in capsys.readouterr().err


def test_unknown_subcommand_fails_with_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["nope"])
    assert exit_.value.code != 0 and "usage" in capsys.readouterr().err


def test_warm_rejects_bad_heads_and_dtypes():
    for args, message in ((("--heads", "4x6"), "HV must be a positive multiple of H"),
                          (("--heads", "16"), "expected HxHV pairs"),
                          (("--heads", "4x8", "--dtypes", "float32"), "tilelang_sm90 builds bfloat16, float16")):
        with pytest.raises(SystemExit) as exit_:
            main(["warm", *args])
        assert exit_.value.code != 0 and message in str(exit_.value.code), args


def test_warm_reads_a_models_heads_from_its_config(tmp_path):
    """`warm --model`: the GDN heads and dtype of a transformers config.json (top level, or a multimodal config's
    text_config), or an error naming what is missing or unsupported."""
    import json

    from gdnkit.__main__ import _model_heads
    text = {"linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "dtype": "float16"}
    (tmp_path / "vl").mkdir()
    (tmp_path / "vl" / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text,
                                                             "torch_dtype": "bfloat16"}))
    assert _model_heads(str(tmp_path / "vl")) == ([(16, 48)], "float16")
    flat = dict(text, linear_num_key_heads=8, linear_num_value_heads=32)
    del flat["dtype"]
    (tmp_path / "flat.json").write_text(json.dumps(flat))
    assert _model_heads(str(tmp_path / "flat.json")) == ([(8, 32)], "bfloat16")
    for config, message in (({"hidden_size": 8}, "no GDN layers"), (dict(text, linear_key_head_dim=256), "K = V = 128"),
                            (dict(text, linear_num_value_heads=20), "HV must be a positive multiple of H")):
        (tmp_path / "bad.json").write_text(json.dumps(config))
        with pytest.raises(SystemExit) as exit_:
            _model_heads(str(tmp_path / "bad.json"))
        assert message in str(exit_.value.code), config
    with pytest.raises(SystemExit, match="cannot read"):
        _model_heads(str(tmp_path / "missing"))
    with pytest.raises(SystemExit) as exit_:
        main(["warm", "--heads", "4x8", "--model", str(tmp_path / "flat.json")])
    assert "--heads or --model" in str(exit_.value.code)


def test_warm_family_covers_training_and_inference():
    from gdnkit.backends.tilelang_sm90 import precompile
    inference = precompile.family(4, 16, "bfloat16", training=False)
    training = precompile.family(4, 16, "bfloat16", training=True)
    assert set(inference) < set(training)
    assert {j.factory for j in training} == {"intra_chunk_kernel", "state_output_kernel", "propagator_kernel",
                                             "backward_state_kernel", "chunk_grads_kernel", "backward_fused_kernel"}
    assert len(set(training)) == len(training)
    # one backward's kernels: the staged path's, or the fused path's (its gated route's passes, storing only dS)
    staged = set(precompile.family(4, 16, "bfloat16", backward="staged"))
    fused = set(precompile.family(4, 16, "bfloat16", backward="fused"))
    assert staged | fused == set(training) and set(inference) < staged & fused
    # the recompute of S0 stores X too for the fused kernel (state_output_kernel's store_x), at two programs an SM
    # where its V tile is 64 columns (the last argument)
    assert {j.factory for j in fused - staged} == {"backward_fused_kernel", "state_output_kernel"}
    from gdnkit.backends.tilelang_sm90.forward import NARROW_BLOCK_V, recompute_per_sm
    assert {j.args[9:] for j in fused - staged if j.factory == "state_output_kernel"} == \
        {(True, recompute_per_sm(bv, True)) for bv in NARROW_BLOCK_V}
    assert {j.factory for j in staged - fused} == {"chunk_grads_kernel", "backward_state_kernel", "state_output_kernel"}
    assert {j.args[9:] for j in staged - fused if j.factory == "state_output_kernel"} == {(False, 1)}
    passes = [j.args for j in fused if j.factory == "backward_state_kernel"]
    assert passes and all(ds_only for *_, ds_only in passes)   # the reverse pass with gradient stores: staged only
    with pytest.raises(ValueError, match="backward"):
        precompile.family(4, 16, "bfloat16", backward="fast")
