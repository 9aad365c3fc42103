"""The README's Python examples run as written: each ```python block, executed in a fresh namespace (on the CPU
here, where every call goes to the reference backend; on a GPU where one is present)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, capsys):
    exec(compile(BLOCKS[index], f"README.md python block {index + 1}", "exec"), {"__name__": "readme_example"})


def test_the_readme_stays_short():
    """The README is the front door: under 1,500 words, and no table cell a paragraph (over 60 words); detail
    belongs in docs/."""
    text = README.read_text()
    assert len(re.findall(r"\S+", text)) < 1500
    cells = [c for line in text.splitlines() if line.startswith("|") for c in line.strip("|").split("|")]
    assert cells and max(len(c.split()) for c in cells) <= 60
