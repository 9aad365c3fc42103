"""The wheel installs dispatch/ and backends/ inside the gdnkit namespace, nothing generic at top level."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_contents(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                          str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = tmp_path.glob("gdnkit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops <= {"gdnkit", *(t for t in tops if t.endswith(".dist-info"))}, tops
    for module in ("gdnkit/api.py", "gdnkit/dispatch/select.py", "gdnkit/backends/reference/chunked.py",
                   "gdnkit/backends/triton_shared/segments.py", "gdnkit/backends/tilelang_sm90/lead_in.py",
                   "gdnkit/benchmarks/__init__.py"):
        assert module in names, module

    # A regular (non-editable) install of that wheel computes, from outside the checkout.
    site = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                          str(wheel)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    code = ("import torch, gdnkit\n"
            "assert gdnkit.__file__.startswith(%r), gdnkit.__file__\n"
            "x = [torch.randn(1, 5, 1, 4) for _ in range(3)]\n"
            "o, s = gdnkit.chunk_gated_delta_rule(*x, -torch.rand(1, 5, 1), torch.rand(1, 5, 1),"
            " output_final_state=True)\n"
            "assert o.shape == (1, 5, 1, 4) and s.shape == (1, 1, 4, 4)\n") % str(site)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


@pytest.mark.slow
def test_installed_layout_is_namespaced(tmp_path):
    # In a fresh interpreter outside the checkout, so the repository root is not on sys.path.
    code = ("import gdnkit.backends.reference, gdnkit.dispatch, importlib.util\n"
            "assert gdnkit.dispatch.__name__ == 'gdnkit.dispatch'\n"
            "assert importlib.util.find_spec('backends') is None and importlib.util.find_spec('dispatch') is None\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
