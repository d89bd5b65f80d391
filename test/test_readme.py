"""The README's example runs as written."""

from __future__ import annotations

import pathlib

import pytest
import torch

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def example_code() -> str:
    text = README.read_text()
    start = text.index("```python", text.index("## Example")) + len("```python")
    return text[start:text.index("```", start)]


@pytest.mark.filterwarnings("ignore:XLA_USE_SPMD is being deprecated")  # the example enables SPMD again
def test_readme_example_runs(capsys):
    torch.manual_seed(0)  # the example's torch.randn draws
    exec(compile(example_code(), str(README), "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out
    # One printed line per parameter: a and b are inputs, the 2.0 is a hoisted scalar.
    kinds = [line.split()[-1] for line in out.splitlines() if line.split()[-1:] in (["input"], ["hoisted"], ["seed"])]
    assert sorted(kinds) == ["hoisted", "input", "input"], out
    assert "Parameters (3)" in out and "Host transfers (0)" in out
