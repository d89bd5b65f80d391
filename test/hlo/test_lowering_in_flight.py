"""LoweringContext right after ``torch_xla.sync()``: the results still in flight are waited for, never read.

``sync()`` returns before its execution finishes; under SPMD each result is a
sharded placeholder with no shards until then, and torch_xla 2.9 dereferences
its first shard when a graph reading it is walked or lowered. Before the wait
in ``build``, the issue's sequence below died with a segmentation fault in
most runs (5 of 10 here; torch_xla's own LoweringContext too). The sequences
run in a child process, ten rounds each, with both mapping implementations.
"""

from __future__ import annotations

import textwrap

import pytest

from child_process import SPMD_CHILD, run_surviving

_CHILD = SPMD_CHILD + textwrap.dedent('''
    from torch_xla_ext import LoweringContext
    impl = sys.argv[1]
    for round in range(10):
        # The issue's sequence: mapped tensors outlive their originals, then a new build.
        x = torch.arange(8.).to(dev) + 1; xs.mark_sharding(x, mesh, ("fsdp",)); y = torch.full((8,), 3.).to(dev)
        torch_xla.sync()
        c = LoweringContext("a", device_mapping=impl); c.build([x * y]); m = c.device_parameter_id_tensor_mapping()
        del x, y; gc.collect(); torch_xla.sync()
        x2 = torch.arange(8.).to(dev) + 1; torch_xla.sync()
        b = LoweringContext("b", device_mapping=impl); b.build([x2 * 2])
        assert b.tensor_parameter_id(x2) >= 0
        # A build on a tensor with a pending in-place op, and ids asked right after a sync.
        x2.mul_(3)
        LoweringContext("c", device_mapping=impl).build([x2 + 1])
        torch_xla.sync()
        d = LoweringContext("d", device_mapping=impl); d.build([x2 * x2])
        assert d.tensor_parameter_ids([x2]) == [d.tensor_parameter_id(x2)]
        try:
            d.build([x2])
            raise SystemExit("build twice was not refused")
        except RuntimeError as error:
            assert "already built" in str(error)
        values = sorted(round_sum for round_sum in (t.cpu().sum().item() for t in m.values()))
        assert values == [24.0, 36.0], values
        assert x2.cpu().tolist() == [3.0 * (i + 1) for i in range(8)]
    print("survived", impl)
''')


@pytest.mark.parametrize("impl", ["native", "fallback"])
def test_build_and_ids_right_after_a_sync_never_crash(tmp_path, impl):
    assert f"survived {impl}" in run_surviving(tmp_path, _CHILD, impl)
