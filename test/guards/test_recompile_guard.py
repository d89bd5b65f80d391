"""no_recompiles(): XLA compiling inside the block raises RecompileError naming the call site and what changed."""

from __future__ import annotations

import pytest
import torch
import torch_xla
import torch_xla.distributed.spmd as xs

import torch_xla_ext as txe


def _step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.tanh(x @ w).sum(0)
    torch_xla.sync()
    return out


def _weight(device) -> torch.Tensor:
    w = torch.randn(3, 5, device=device)  # with x of 4, 6, 2 or 9 rows: shapes no other test compiles
    torch_xla.sync()  # device data from here on: the steps' graphs read it
    return w


def test_steady_steps_pass_and_a_new_shape_is_named(device):
    w = _weight(device)
    _step(torch.randn(4, 3, device=device), w)  # compiles: outside the guard
    with txe.no_recompiles():
        for _ in range(3):
            _step(torch.randn(4, 3, device=device), w)  # cached
    with pytest.raises(txe.RecompileError) as caught:
        with txe.no_recompiles():
            _step(torch.randn(4, 3, device=device), w)  # the site's graph is seen once, cached
            _step(torch.randn(6, 3, device=device), w)  # a new batch size: a new program
    message = str(caught.value)
    assert "compiled 1 program(s)" in message and "test_recompile_guard.py" in message, message
    # The new program's ops run on the new shape (x is drawn inside the graph, so it is no input).
    assert "ops: before" in message and "f32[4,3]" in message and "f32[6,3]" in message, message


def test_a_compile_without_an_earlier_graph_from_the_site_says_so(device):
    with pytest.raises(txe.RecompileError, match="no earlier graph from this call site"):
        with txe.no_recompiles():
            y = torch.arange(7001.0, device=device) * 3.25 - 1  # a shape no other test compiles
            torch_xla.sync()
    del y


def test_a_compile_made_by_a_host_read_is_counted(device):
    with pytest.raises(txe.RecompileError, match="1 more compiled outside a wrapped torch_xla.sync"):
        with txe.no_recompiles():
            (torch.arange(7013.0, device=device) * 0.5).sum().item()  # runs, and compiles, a new graph


def test_the_body_s_exception_propagates_unjudged(device):
    with pytest.raises(KeyError):
        with txe.no_recompiles():
            torch.arange(13.0, device=device).sum().item()  # compiles
            raise KeyError("mine")


def test_nested_guards_each_judge_their_block(device):
    w = _weight(device)
    _step(torch.randn(2, 3, device=device), w)
    with pytest.raises(txe.RecompileError) as outer:
        with txe.no_recompiles():
            _step(torch.randn(2, 3, device=device), w)
            with pytest.raises(txe.RecompileError):
                with txe.no_recompiles():
                    _step(torch.randn(9, 3, device=device), w)
    assert "f32[9,3]" in str(outer.value)  # the inner compile is the outer block's too


def test_a_changed_output_sharding_is_named(device, mesh):
    w = torch.randn(3, 16, device=device)
    torch_xla.sync()

    def step(spec):
        y = torch.tanh(torch.ones(40, 3, device=device) @ w)  # 40 rows: a shape no other test compiles
        xs.mark_sharding(y, mesh, spec)
        torch_xla.sync()
        return y

    step((None, None))  # compiles, outside the guard
    with pytest.raises(txe.RecompileError) as caught:
        with txe.no_recompiles():
            step((None, None))  # cached
            step((None, mesh.axis_names[0]))  # the same ops and shapes, sharded over the columns
    message = str(caught.value)
    assert "shardings: before output f32[40,16] {replicated}; now output f32[40,16] {devices=" in message, message
    assert "ops:" not in message and "inputs:" not in message, message


def test_the_pending_graph_lists_each_node_once_and_only_pending_outputs(device):
    from torch_xla_ext.recompile_guard import _pending_ir, _summary

    base = torch.randn(5, device=device)
    torch_xla.sync()
    chain = [base * 2]  # base now also holds an IR value (its device data), but no pending one
    for _ in range(39):
        chain.append(chain[-1] + 1)  # each a pending output whose graph holds all the adds before it
    summary = _summary(_pending_ir())
    assert summary[("output", "f32[5]")] == 40, summary
    assert summary[("op", "aten::add -> f32[5]{0}")] == 39, summary  # not 1 + 2 + ... + 39
    assert summary[("input", "f32[5]{0}")] == 1, summary
    torch_xla.sync()
    assert _pending_ir() == ""
    del chain


@pytest.mark.no_recompiles
def test_the_marker_passes_a_body_that_compiles_nothing(device):
    torch.ones(3, device=device).sum()  # pending only; nothing is compiled


def test_the_marker_fails_a_body_that_compiles(pytester):
    pytester.makeconftest(
        "import os\n"
        "os.environ.setdefault('PJRT_DEVICE', 'CPU')\n"
        "os.environ.setdefault('CPU_NUM_DEVICES', '8')\n"
        "import torch_xla.runtime as xr\n"
        "xr.use_spmd()\n"
    )
    pytester.makepyfile(
        "import pytest, torch, torch_xla\n"
        "@pytest.mark.no_recompiles\n"
        "def test_compiles():\n"
        "    (torch.arange(5.0, device=torch_xla.device()) + 2).sum().item()\n"
        "def test_fixture(no_recompiles):\n"
        "    (torch.arange(6.0, device=torch_xla.device()) + 2).sum().item()\n"
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, passed=1, errors=1)  # the fixture's guard fails at its teardown
    result.stdout.fnmatch_lines(["*RecompileError: XLA compiled 1 program(s) inside a no_recompiles() block*"])
