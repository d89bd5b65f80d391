"""The README runs as written: its example, and every block fenced as python, in order, in a new process."""

from __future__ import annotations

import pathlib
import textwrap

import pytest
import torch

from child_process import run_surviving

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
#: The guides, in the order they are read: a block may use what an earlier one (or README's) made.
GUIDES = [README.parent / "docs" / name for name in
          ("scan.md", "fsdp.md", "guards.md", "tpu.md", "limitations.md", "hf.md", "design.md")]


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


def python_blocks() -> list[tuple[str, str]]:
    """Every block fenced as ``python`` in README.md, then in each guide, in order, with ``file:line`` where it
    starts (listings are fenced as text)."""
    blocks = []
    for path in [README, *GUIDES]:
        text = path.read_text()
        start = 0
        while (start := text.find("```python\n", start)) != -1:
            body = start + len("```python\n")
            end = text.index("```", body)
            # A block inside a list item is indented like the item.
            where = f"{path.relative_to(README.parent)}:{text.count(chr(10), 0, start) + 1}"
            blocks.append((where, textwrap.dedent(text[body:end])))
            start = end + 3
    return blocks


_RUN_BLOCKS = """
import sys, types
sys.path.insert(0, sys.argv[1])
from test_readme import python_blocks, README
module = types.ModuleType("readme_blocks")  # a real module: dynamo looks the globals' module up by name
sys.modules[module.__name__] = module
for where, code in python_blocks():
    print(f"--- block at {where}", flush=True)
    exec(compile(code, where, "exec"), module.__dict__)
print("fits:", module.__dict__["r"].fits)
"""


def test_every_python_block_runs_in_order(tmp_path, monkeypatch):
    # The README reads top to bottom: a block may use what an earlier one made (the Trainer example's
    # config and mesh). A new process, as a reader's would be: it starts from the environment the first
    # block sets up, and a crash fails this test instead of the suite. Files land in a temporary directory.
    assert len(python_blocks()) >= 8
    monkeypatch.chdir(tmp_path)
    out = run_surviving(tmp_path, _RUN_BLOCKS, str(pathlib.Path(__file__).resolve().parent))
    assert out.count("--- block at ") == len(python_blocks())
    assert (tmp_path / "out" / "checkpoint-4" / "sharded").is_dir()
    assert "fits: True" in out  # the TPU fit check's result for the tiny Llama
