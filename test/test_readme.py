"""The README's example runs as written."""

from __future__ import annotations

import pathlib

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def example_code() -> str:
    text = README.read_text()
    start = text.index("```python", text.index("## Example")) + len("```python")
    return text[start:text.index("```", start)]


@pytest.mark.filterwarnings("ignore:XLA_USE_SPMD is being deprecated")  # the example enables SPMD again
def test_readme_example_runs(capsys):
    exec(compile(example_code(), str(README), "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out
    assert "input" in out and "hoisted" in out
    assert "Parameters (3)" in out and "Host transfers (0)" in out
