"""The sharding annotation fully_shard and scan put on values: a copy carrying the sharding, the source untouched,
no data moved, whatever the source holds."""

from __future__ import annotations

import pytest
import torch
import torch_xla
import torch_xla.distributed.spmd as xs

from torch_xla_ext._annotate import Annotator, annotate_sharding, is_replicated_spec
from torch_xla_ext._xla import xlac
from torch_xla_ext.testing import measure_transfers



def _spec(t: torch.Tensor) -> str:
    spec = xlac()._get_xla_sharding_spec(t)
    return "{replicated}" if is_replicated_spec(spec) else spec  # '' and '{replicated}' mean the same


@pytest.mark.parametrize("source", ["replicated data", "data sharded otherwise", "pending value"])
@pytest.mark.parametrize("how", ["annotate_sharding", "Annotator"])
def test_an_annotated_copy_carries_the_sharding_and_leaves_its_source_and_the_host_alone(device, mesh, source, how):
    torch.manual_seed(0)
    host = torch.randn(64, 16)
    t = host.to(device)
    if source == "data sharded otherwise":
        xs.mark_sharding(t, mesh, (None, "fsdp"))
    torch_xla.sync()
    if source == "pending value":
        t = t * 2
        host = host * 2
    before = _spec(t)
    annotate = Annotator(mesh, ("fsdp", None)) if how == "Annotator" else (
        lambda v: annotate_sharding(v, mesh, ("fsdp", None)))
    with measure_transfers() as m:
        out = annotate(t)
        assert _spec(out) == _spec(annotate(torch.zeros(64, 16, device=device))) != before
        assert _spec(t) == before
        torch_xla.sync()
    assert not m.device_to_host and m.stats.replicate_sharded_data == 0, m.report()
    assert "devices=[8,1]" in _spec(out)
    torch.testing.assert_close(out.cpu(), host, rtol=0, atol=0)
    torch.testing.assert_close(t.cpu(), host, rtol=0, atol=0)


class _Gathered(torch.autograd.Function):
    """fully_shard's use: a gathered weight (recomputed in scan's backward when asked), its gradient sharded."""

    @staticmethod
    def forward(ctx, t, mesh, recompute: bool):
        ctx.mesh = mesh
        return annotate_sharding(t, mesh, (None, None), recompute_in_backward=recompute)

    @staticmethod
    def backward(ctx, grad):
        return annotate_sharding(grad, ctx.mesh, ("fsdp", None)), None, None


def test_a_scan_step_annotated_otherwise_is_another_plan_not_a_reused_one(device, mesh):
    """Two steps of one code that differ only in an annotation (its spec or recompute_in_backward) lower
    to different loops: scan keys its plan by the annotation, which no torch op of the step shows."""
    import torch_xla_ext as txe
    from torch_xla_ext import LoweringContext
    from torch_xla_ext._annotate import shard_activation
    from torch_xla_ext.scan import scan_cache_info

    def lowered(recompute: bool, spec: tuple) -> bytes:
        torch.manual_seed(0)
        init, w = torch.randn(16, 64).to(device), torch.randn(4, 64, 64).to(device)
        xs.mark_sharding(w, mesh, (None, "fsdp", None))
        w.requires_grad_()

        def step(c, x):
            return shard_activation(torch.tanh(c @ _Gathered.apply(x, mesh, recompute)), mesh, spec), None

        c, _ = txe.scan(step, init, w)
        c.sum().backward()
        ctx = LoweringContext("annotated_step")
        ctx.build([c, w.grad])
        return ctx.hlo()

    before = scan_cache_info()
    programs = {variant: lowered(*variant) for variant in
                [(False, ("fsdp", None)), (True, ("fsdp", None)), (True, (None, None))]}
    again = lowered(True, (None, None))
    after = scan_cache_info()
    assert len(set(programs.values())) == 3  # each annotation its own program
    assert again == programs[(True, (None, None))] and after.hits - before.hits >= 1  # the same one reused
    assert after.traces - before.traces >= 3
