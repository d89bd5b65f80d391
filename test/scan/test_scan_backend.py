"""The XLA:CPU lowering choices (index guard, merged stacking) apply only behind their switch; neither uploads
anything; the guard does not depend on the SPMD partition."""

from __future__ import annotations

import pathlib
import re
import textwrap

import pytest
import torch
import torch_xla

import torch_xla_ext as txe
from torch_xla_ext._scan.backend import CPU_CODEGEN_ENV, cpu_codegen, forced_cpu_codegen
from torch_xla_ext.scan import clear_scan_cache
from torch_xla_ext.testing import measure_transfers

from child_process import run_child
from scan_reference import assert_close_derived

X = torch_xla._XLAC


def _step(c, x):
    return c * x + 1.0, (c.sum(), c * x)


def _lowered(outputs) -> str:
    return X._get_xla_tensors_hlo(list(outputs))


def test_the_cpu_device_turns_the_choices_on(device):
    assert cpu_codegen()


@pytest.mark.parametrize("on", [True, False], ids=["cpu", "other_backend"])
def test_scan_lowers_the_guard_only_for_xla_cpu_and_uploads_nothing(device, on):
    clear_scan_cache()
    init, xs_ = torch.ones(4, device=device), torch.full((3, 4), 0.5, device=device)
    torch_xla.sync(wait=True)  # init and xs as device data, their computation finished
    with forced_cpu_codegen(on), measure_transfers() as moved:
        carry, ys = txe.scan(_step, init, xs_)  # the first scan after clearing the cache
    assert moved.stats.h2d_transfers == 0 and not moved.device_to_host, moved.report()
    hlo = _lowered([carry, *ys])
    # Reads: select(iota < bound, ...); stores: select(bound > 0, ...); the
    # bound is the loop counter | 2**30.
    assert ("iota" in hlo) == on and ("select" in hlo) == on and ("or(" in hlo) == on, hlo
    assert bool(re.search(r"pred\[\] compare\([^\n]*direction=GT", hlo)) == on, hlo
    assert "s32[1]" not in hlo  # the bound is not an operand on any backend
    torch.testing.assert_close(carry.cpu(), torch.full((4,), 1.875))
    torch.testing.assert_close(ys[0].cpu(), torch.tensor([4.0, 6.0, 7.0]))
    torch.testing.assert_close(ys[1].cpu(), torch.tensor([[0.5] * 4, [0.75] * 4, [0.875] * 4]))


@pytest.mark.parametrize("on", [True, False], ids=["cpu", "other_backend"])
def test_scan_layers_stacks_merged_members_only_for_xla_cpu(device, mesh, on):
    import torch_xla.distributed.spmd as xs

    torch.manual_seed(0)
    cpu_layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(3)])
    layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(3)])
    layers.load_state_dict(cpu_layers.state_dict())
    layers = layers.to(device)
    for layer in layers:
        xs.mark_sharding(layer.weight, mesh, ("fsdp", None))
    x_cpu = torch.randn(4, 16)
    clear_scan_cache()
    with forced_cpu_codegen(on):
        out = txe.scan_layers(layers, x_cpu.to(device))
        out.square().sum().backward()
    grads = [layer.weight.grad for layer in layers]
    hlo = _lowered([out, *grads])
    # Merged: each stacked [16, 16] weight is an f32[3,256]; kept: f32[3,16,16].
    assert ("f32[3,256]" in hlo) == on and ("f32[3,16,16]" in hlo) != on, hlo
    assert ("or(" in hlo) == on and "s32[1]" not in hlo
    ref = x_cpu
    for layer in cpu_layers:
        ref = layer(ref)
    ref.square().sum().backward()
    assert_close_derived(out, ref, 3 * 16)
    for got, want in zip(grads, [layer.weight.grad for layer in cpu_layers]):
        assert_close_derived(got, want, 3 * 16 * 4)


def test_the_environment_variable_forces_the_choice(device, monkeypatch):
    monkeypatch.setenv(CPU_CODEGEN_ENV, "0")
    assert not cpu_codegen()
    monkeypatch.setenv(CPU_CODEGEN_ENV, "1")
    assert cpu_codegen()
    monkeypatch.setenv(CPU_CODEGEN_ENV, "yes")
    with pytest.raises(ValueError, match="must be 1 .* or 0"):
        cpu_codegen()


_PARTITIONED_SCAN = textwrap.dedent("""
    import numpy as np, torch, torch_xla, torch_xla.runtime as xr, torch_xla.distributed.spmd as xs
    import torch_xla_ext as txe
    xr.use_spmd()
    mesh = xs.Mesh(np.arange(8), (8,), ("fsdp",))
    init = torch.ones(16, 32).to(torch_xla.device())
    seq = torch.randn(3, 16, 32).to(torch_xla.device())
    xs.mark_sharding(init, mesh, ("fsdp", None))
    xs.mark_sharding(seq, mesh, (None, "fsdp", None))
    carry, ys = txe.scan(lambda c, x: (c * x + 1.0, c * x), init, seq)
    torch_xla.sync()
""")


def test_the_guard_of_a_batch_sharded_read_does_not_depend_on_the_partition(tmp_path):
    # An iota along the sharded batch dim differs per partition: XLA hoisted it
    # out of the loop as an s32[2,32] table the loop carried and read every
    # iteration. Along the last (unsharded) dim it is the same on every device and
    # stays inside the loop body. XLA reads its dump flags at start-up: a child process.
    run_child(["-c", _PARTITIONED_SCAN], timeout=300, env=dict(
        TF_CPP_MIN_LOG_LEVEL="3", XLA_FLAGS=f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=NONE"))
    programs = sorted(pathlib.Path(tmp_path).glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)
    assert programs, "XLA dumped no optimized program"
    loops = re.findall(r"= \(([^=]*)\) while\(", programs[-1].read_text())
    assert len(loops) == 1, loops
    # Counter, carry shard, xs shard, ys shard: nothing else rides along the loop.
    operands = re.sub(r"\{[\d,]*\}", "", loops[0]).split(", ")
    assert operands == ["s32[]", "f32[2,32]", "f32[3,2,32]", "f32[3,2,32]"], operands


def test_a_backward_keeps_the_choice_its_forward_was_planned_with(device):
    # The backward loop and the gradients' unstacking are lowered on autograd's thread, after the block.
    clear_scan_cache()
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(3)]).to(device)
    x = torch.randn(4, 16).to(device)
    with forced_cpu_codegen(False):
        out = txe.scan_layers(layers, x)
    out.square().sum().backward()
    hlo = _lowered([out, *(layer.weight.grad for layer in layers)])
    assert "or(" not in hlo and "f32[3,16,16]" in hlo, hlo


def test_one_threads_choice_leaves_another_threads_scans_alone(device):
    import threading

    clear_scan_cache()
    inside, done, seen = threading.Event(), threading.Event(), []

    def hold():  # a thread building a TPU program (tpu.lowering) while this one scans
        with forced_cpu_codegen(False):
            inside.set()
            done.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert inside.wait(60)
        seen.append(cpu_codegen())
        carry, ys = txe.scan(_step, torch.ones(4, device=device), torch.full((3, 4), 0.5, device=device))
        hlo = _lowered([carry, *ys])
    finally:
        done.set()
        holder.join(60)
    assert seen == [True] and "or(" in hlo, hlo
