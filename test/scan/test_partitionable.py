"""The partitionable LayerNorm scan traces with: eager values and gradients, eager's errors, no batch-norm ops,
and no all-gather of a batch-sharded activation in the partitioned program."""

from __future__ import annotations

import pathlib
import re
import textwrap

import pytest
import torch
import torch.nn.functional as F
import torch_xla

import torch_xla_ext as txe
from torch_xla_ext._partitionable import layer_norm, partitionable_ops
from torch_xla_ext.testing.tolerances import tolerance

from child_process import run_child

X_SHAPE = (3, 5, 4, 8)


def _args(dtype, normalized, affine):
    x = (torch.randn(X_SHAPE) * 3 + 1).to(dtype)
    w = (torch.rand(normalized) + 0.5).to(dtype) if affine in ("both", "weight") else None
    b = torch.randn(normalized).to(dtype) if affine == "both" else None
    return x, w, b


@pytest.mark.parametrize("normalized", [(8,), (4, 8)], ids=["last", "last2"])
@pytest.mark.parametrize("affine", ["both", "weight", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_layer_norm_matches_eager_values_and_gradients(dtype, normalized, affine):
    x, w, b = _args(dtype, normalized, affine)
    leaves = [t.requires_grad_() for t in (x, w, b) if t is not None]
    ours = layer_norm(x, normalized, w, b, eps=1e-5)
    g = torch.randn_like(ours)
    ours_grads = torch.autograd.grad(ours, leaves, g)
    ref = F.layer_norm(x, normalized, w, b, eps=1e-5)
    ref_grads = torch.autograd.grad(ref, leaves, g)
    n = 1
    for d in normalized:
        n *= d
    torch.testing.assert_close(ours, ref, **tolerance(dtype, n))
    # An input's gradient reduces over the n normalized elements; a weight's or
    # bias's also sums over the x.numel() // n rows.
    for mine, theirs in zip(ours_grads, ref_grads):
        scale = float(theirs.square().mean().sqrt())
        torch.testing.assert_close(mine, theirs, **tolerance(dtype, n + x.numel() // n, scale=scale))


@pytest.mark.parametrize("grads", ["all", "input"])
@pytest.mark.parametrize("normalized", [(8,), (4, 8)], ids=["last", "last2"])
@pytest.mark.parametrize("affine", ["both", "weight", "bias", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_lazy_layer_norm_is_one_computation_each_way_and_matches_eager(device, dtype, normalized, affine, grads):
    x, w, b = _args(dtype, normalized, affine if affine != "bias" else "both")
    if affine == "bias":
        w = None
    wanted = [t for t in ((x, w, b) if grads == "all" else (x,)) if t is not None]
    for t in wanted:
        t.requires_grad_()
    ref = F.layer_norm(x, normalized, w, b, eps=1e-5)
    g = torch.randn(ref.shape).to(dtype)
    ref_grads = torch.autograd.grad(ref, wanted, g)

    on_device = [None if t is None else t.detach().to(device).requires_grad_(t.requires_grad) for t in (x, w, b)]
    leaves = [t for t in on_device if t is not None and t.requires_grad]
    ours = layer_norm(on_device[0], normalized, on_device[1], on_device[2], eps=1e-5)
    ours_grads = torch.autograd.grad(ours, leaves, g.to(device))
    forward_hlo, backward_hlo = lazy_hlo(ours), lazy_hlo(*ours_grads)
    assert "txe_layer_norm" in forward_hlo and "batch-norm" not in forward_hlo
    assert "txe_layer_norm_backward" in backward_hlo and "batch-norm" not in backward_hlo
    n = 1
    for d in normalized:
        n *= d
    if dtype == torch.bfloat16:  # computed in float32 and rounded once, as eager does
        torch.testing.assert_close(ours.cpu(), ref, rtol=torch.finfo(dtype).eps, atol=0)
    else:
        torch.testing.assert_close(ours.cpu(), ref, **tolerance(dtype, n))
    for mine, theirs in zip(ours_grads, ref_grads):
        scale = float(theirs.float().square().mean().sqrt())
        torch.testing.assert_close(mine.cpu(), theirs, **tolerance(dtype, n + x.numel() // n, scale=scale))


def test_lazy_layer_norm_second_derivatives_match_eager(device):
    # create_graph: the backward is recorded op by op (the prebuilt one has no derivative).
    x, w, b = _args(torch.float64, (4, 8), "both")
    g = torch.randn(X_SHAPE, dtype=torch.float64)
    results = []
    for fn, dev in ((layer_norm, device), (F.layer_norm, torch.device("cpu"))):
        leaves = [t.detach().to(dev).requires_grad_() for t in (x, w, b)]
        first = torch.autograd.grad((fn(leaves[0], (4, 8), leaves[1], leaves[2]) * g.to(dev)).sum(), leaves,
                                    create_graph=True)
        second = torch.autograd.grad(sum((f * f).sum() for f in first), leaves, allow_unused=True)
        results.append([None if t is None else t.detach().cpu() for t in first + second])
    for mine, theirs in zip(*results):
        assert (mine is None) == (theirs is None)
        if theirs is not None:
            torch.testing.assert_close(mine, theirs,
                                       **tolerance(torch.float64, 64 + 60, scale=float(theirs.abs().max())))


@pytest.mark.parametrize("affine", ["both", "none"])
def test_second_derivatives_match_eager(affine):
    # The closed-form backward recomputes its statistics under create_graph.
    x, w, b = _args(torch.float64, (4, 8), affine)
    leaves = [t.requires_grad_() for t in (x, w, b) if t is not None]
    g = torch.randn(X_SHAPE, dtype=torch.float64)
    results = []
    for fn in (layer_norm, F.layer_norm):
        first = torch.autograd.grad((fn(x, (4, 8), w, b) * g).sum(), leaves, create_graph=True)
        second = torch.autograd.grad(sum((f * f).sum() for f in first), leaves, allow_unused=True)
        results.append(first + second)
    for mine, theirs in zip(*results):
        assert (mine is None) == (theirs is None)
        if theirs is not None:
            torch.testing.assert_close(mine, theirs,
                                       **tolerance(torch.float64, 64 + 60, scale=float(theirs.detach().abs().max())))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_are_normalized_in_float32_and_rounded_once(dtype):
    x, w, b = _args(dtype, (8,), "both")
    ours = layer_norm(x, (8,), w, b)
    assert ours.dtype == dtype
    # Eager CPU computes in float32 and rounds once: at most one rounding apart.
    torch.testing.assert_close(ours, F.layer_norm(x, (8,), w, b), rtol=torch.finfo(dtype).eps, atol=0)
    mixed = layer_norm(x, (8,), w.float(), b.float())
    torch.testing.assert_close(mixed, F.layer_norm(x, (8,), w.float(), b.float()),
                               rtol=torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("args", [
    ((7,), None, None),                                # normalized shape is not the input's last dims
    ((8,), torch.ones(7), None),                       # weight of the wrong shape
    ((8,), None, torch.ones(8, dtype=torch.float64)),  # bias of another dtype
], ids=["shape", "weight", "bias-dtype"])
def test_arguments_eager_rejects_raise_eagers_error(args):
    x = torch.randn(X_SHAPE)
    with pytest.raises(RuntimeError) as eager:
        F.layer_norm(x, *args)
    with pytest.raises(RuntimeError) as ours:
        layer_norm(x, *args)
    assert str(ours.value) == str(eager.value)


def test_the_mode_routes_module_and_functional_layer_norms(device):
    norm = torch.nn.LayerNorm(8).to(device)
    x = torch.randn(4, 8, device=device)

    assert "batch-norm-training" in lazy_hlo(norm(x))
    with partitionable_ops():
        for fn in (norm, lambda t: F.layer_norm(t, (8,)), lambda t: torch.layer_norm(t, (8,))):
            assert "batch-norm" not in lazy_hlo(fn(x))


def lazy_hlo(*tensors: torch.Tensor) -> str:
    """HLO text of the lazy graph computing ``tensors`` (before XLA's passes)."""
    return torch_xla._XLAC._get_xla_tensors_hlo(list(tensors))


def test_scan_lowers_no_batch_norm_forward_or_backward(device):
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
                                 for _ in range(3)).to(device)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    out = txe.scan_layers(layers, x)
    (grad_x,) = torch.autograd.grad(out.square().sum(), [x])
    text = lazy_hlo(out, grad_x)
    assert "while" in text and "batch-norm" not in text


_PARTITIONED = textwrap.dedent("""
    import sys
    import numpy as np, torch, torch_xla, torch_xla.runtime as xr, torch_xla.distributed.spmd as xs
    import torch_xla_ext as txe
    from torch_xla_ext._partitionable import partitionable_ops
    xr.use_spmd()
    torch.manual_seed(0)
    mesh = xs.Mesh(np.arange(8), (8,), ("fsdp",))
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 32))
                                 for _ in range(3)).to(torch_xla.device())
    for layer in layers:
        xs.mark_sharding(layer[1].weight, mesh, ("fsdp", None))
    x = torch.randn(8, 16, 32).to(torch_xla.device())
    xs.mark_sharding(x, mesh, ("fsdp", None, None))
    if sys.argv[1] == "scan":
        out = txe.scan_layers(layers, x)
    else:  # lazy tensors, op by op: each LayerNorm is one prebuilt computation each way
        out = x
        with partitionable_ops():
            for layer in layers:
                out = layer(out)
    out.square().mean().backward()
    torch_xla.sync()
""")


@pytest.mark.parametrize("how", ["scan", "lazy"])
def test_partitioned_layer_norms_gather_weights_but_never_the_batch_sharded_activation(tmp_path, how):
    # The batch-norm lowering made GSPMD all-gather the whole [8, 16, 32] activation
    # (as f32[1,128,32]) before each LayerNorm and its gradient; only [32, 32]
    # weights may be gathered now. XLA reads its dump flags at start-up: a child process.
    run_child(["-c", _PARTITIONED, how], timeout=300, env=dict(
        TF_CPP_MIN_LOG_LEVEL="3", XLA_FLAGS=f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=NONE"))
    programs = sorted(pathlib.Path(tmp_path).glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)
    assert programs, "XLA dumped no optimized program"
    text = programs[-1].read_text()
    gathered = re.findall(r"= (\w+\[[\d,]*\])\S* all-gather\(", text)
    assert gathered, "the step gathers no weight: the dump is not the training step"
    assert set(gathered) <= {"f32[32,32]"}, gathered
    assert "batch-norm" not in text


def test_entering_again_pushes_no_second_mode():
    from torch.overrides import _get_current_function_mode_stack

    from torch_xla_ext._partitionable import _PartitionableOps

    def active() -> int:
        return sum(isinstance(m, _PartitionableOps) for m in _get_current_function_mode_stack())

    with partitionable_ops():
        with partitionable_ops():
            assert active() == 1
        assert active() == 1
    assert active() == 0


def test_layer_norm_hooks_are_idempotent_survive_copies_and_leave_no_mode_behind(device):
    import copy

    from torch.overrides import _get_current_function_mode_stack

    from torch_xla_ext._partitionable import partition_layer_norms

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).to(device)
    partition_layer_norms(model.modules())
    partition_layer_norms(model.modules())
    assert len(model[1]._forward_pre_hooks) == 1 and len(model[1]._forward_hooks) == 1
    x = torch.randn(4, 8, device=device)
    for m in (model, copy.deepcopy(model)):
        assert "batch-norm" not in lazy_hlo(m(x))
        # Only the LayerNorm's own forward runs under the mode.
        assert not _get_current_function_mode_stack()
    with pytest.raises(RuntimeError):
        model[1](torch.randn(4, 7, device=device))  # eager's shape error, raised under the mode
    assert not _get_current_function_mode_stack()
