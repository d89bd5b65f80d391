"""tpu.compile: the TPU compiler's per-chip figures for a lazy program, here, with no TPU.

Small programs on the suite's 8-device mesh, compiled for 8-chip topologies
(about a second each): the memory statistics against hand counts, the two
ways a program does not fit (outputs past HBM: a peak over it; temporaries
past HBM: the compiler's refusal), the refusals before anything is lowered,
and zero bytes moved to the host.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch
import torch_xla.distributed.spmd as xs

import torch_xla_ext as txe
from torch_xla_ext import tpu
from torch_xla_ext.tpu import _client as _tpu_client
from torch_xla_ext.testing import measure_transfers

_GIB = 1 << 30


def _two_linear_step(device, mesh, width: int = 1024, batch: int = 64):
    torch.manual_seed(0)
    w1 = torch.randn(width, width).to(device).requires_grad_()
    w2 = torch.randn(width, width).to(device).requires_grad_()
    x = torch.randn(batch, width).to(device)
    for t in (w1, w2, x):
        xs.mark_sharding(t, mesh, ("fsdp", None))
    loss = torch.tanh(torch.tanh(x @ w1) @ w2).sum()
    loss.backward()
    return loss, w1, w2, x


@pytest.mark.parametrize("topology", ["v5e:2x4", "v5p:2x2x2", "v6e:2x4"])
def test_a_sharded_step_compiles_with_the_hand_counted_arguments_and_moves_nothing(device, mesh, topology):
    loss, w1, w2, x = _two_linear_step(device, mesh)
    with measure_transfers() as moved:
        r = tpu.compile([loss, w1.grad, w2.grad], topology=topology)
    assert not moved.device_to_host, moved.report()
    # Per chip: an eighth of each weight and of the batch (float32).
    assert r.argument_bytes == (2 * 1024 * 1024 + 64 * 1024) * 4 // 8
    assert r.chips == 8 and r.topology == topology and r.fits
    assert r.hbm_bytes == tpu.HBM_BYTES[r.device_kind]
    assert r.peak_bytes >= r.argument_bytes and r.flops > 0 and r.bytes_accessed > 0 and r.while_loops == 0
    assert r.collectives  # the partitioned program gathers the weights
    assert "peak per chip" in str(r) and "needs per chip" in str(r) and topology in str(r)
    # The HBM buffers hold at least the arguments and the outputs; HBM used adds the program's code.
    assert r.hbm_buffer_bytes >= r.argument_bytes + r.output_bytes - r.alias_bytes
    assert r.hbm_used_bytes == r.hbm_buffer_bytes + r.generated_code_bytes and "HBM used" in str(r)
    # What fits is decided on: the HBM used, not the compiler's statistics (on v5p its temporaries figure is
    # above its own buffer assignment; its peak can count on-chip memory), which only bound it from above.
    held = r.argument_bytes + r.output_bytes - r.alias_bytes + r.temp_bytes + r.generated_code_bytes
    assert r.required_bytes == r.hbm_used_bytes <= max(r.peak_bytes, held)
    assert r.headroom_bytes == r.hbm_bytes - r.required_bytes
    # Nothing ran: the graph is still pending, and runs afterwards.
    assert torch.isfinite(loss.cpu())


def _compile_huge(device, make) -> tpu.CompiledForTpu:
    """Compile a program over a 17 GiB lazy value; the value dies here, so no later sync can run it."""
    return tpu.compile(make(device), topology="v5e:2x4")


def _replicated_output(device):
    return torch.zeros(17 * _GIB // 4, device=device) + 1.0


def _drawn_temporary(device):
    drawn = torch.rand(17 * _GIB // 4, device=device)  # the random bits are a 17 GiB temporary
    return drawn.sum() + drawn.max()


def test_outputs_past_hbm_compile_and_do_not_fit(device):
    # A replicated 17 GiB output: the compiler accepts it (outputs are not checked against HBM), the
    # peak says it does not fit.
    r = _compile_huge(device, _replicated_output)
    assert not r.fits and r.error is None
    assert r.peak_bytes >= 17 * _GIB > r.hbm_bytes
    assert r.hbm_buffer_bytes >= 17 * _GIB
    assert r.headroom_bytes < 0 and "NO" in str(r)


def test_temporaries_past_hbm_are_a_does_not_fit_not_an_exception(device):
    r = _compile_huge(device, _drawn_temporary)
    assert not r.fits and r.error is not None and "RESOURCE_EXHAUSTED" in r.error


def _scan_step(device, mesh, length: int, unrolled: bool = False):
    torch.manual_seed(0)
    h = torch.randn(64, 256).to(device)
    w = torch.randn(length, 256, 256).to(device)
    xs.mark_sharding(h, mesh, ("fsdp", None))
    xs.mark_sharding(w, mesh, (None, "fsdp", None))
    if unrolled:
        for k in range(length):
            h = torch.tanh(h @ w[k])
        return h
    c, _ = txe.scan(lambda c, w: (torch.tanh(c @ w), None), h, w)
    return c


def _compiled_scan(device, mesh, length, unrolled=False):
    with tpu.lowering():
        return tpu.compile(_scan_step(device, mesh, length, unrolled), topology="v5e:2x4")


def test_a_scan_costs_its_body_once_per_trip(device, mesh):
    short, middle, long = (_compiled_scan(device, mesh, n) for n in (2, 4, 8))
    assert (short.trip_counts, middle.trip_counts, long.trip_counts) == ((2,), (4,), (8,)) and "8 trips" in str(long)
    # Linear in the trips: going from 4 to 8 adds twice what going from 2 to 4 adds.
    for figure in ("flops", "bytes_accessed"):
        a, b, c = (getattr(r, figure) for r in (short, middle, long))
        assert c - b == pytest.approx(2 * (b - a), rel=1e-6) and b - a > 0, figure
    # Nearly all flops are the body's: 4 times the trips, 4 times the flops.
    assert long.flops == pytest.approx(4 * short.flops, rel=1e-3)
    # Against the same layers unrolled: the per-layer matmul (64 x 256 @ 256 x 256 per chip after the
    # gather, 2 flops per multiply-add) is nearly all of both (the scan adds under 1% per trip).
    unrolled = _compiled_scan(device, mesh, 8, unrolled=True)
    assert unrolled.while_loops == 0
    matmuls = 8 * 2 * (64 // 8) * 256 * 256
    assert unrolled.flops == pytest.approx(matmuls, rel=1e-3)  # tanh counts as a transcendental
    assert unrolled.flops < long.flops < 1.01 * unrolled.flops
    # Collectives in the body count once per trip: the 2-trip scan's gathers, 4 times over.
    assert long.collectives["all-gather"] == tuple(4 * n for n in short.collectives["all-gather"])


def test_the_compiler_allocates_a_scans_stacked_outputs_without_filling_them(device, mesh, monkeypatch):
    # Why the loop counter is s32 (_scan/loop.py, MAX_LENGTH): the rows are allocated, not zero-filled first.
    compiled = []
    real = _tpu_client.compile_hlo
    monkeypatch.setattr(_tpu_client, "compile_hlo", lambda *a, **k: compiled.append(real(*a, **k)) or compiled[-1])
    length = 6
    torch.manual_seed(0)
    h = torch.randn(64, 256).to(device)
    w = torch.randn(length, 256, 256).to(device)
    xs.mark_sharding(h, mesh, ("fsdp", None))
    xs.mark_sharding(w, mesh, (None, "fsdp", None))
    with tpu.lowering():
        c, ys = txe.scan(lambda c, w: (torch.tanh(c @ w), c * 2), h, w)
        tpu.compile([c, ys], topology="v5e:2x4")
    text = compiled[0].hlo_modules()[0].to_string()
    entry = text[text.index("\nENTRY "):]
    entry = entry[:entry.index("\n}\n")]
    rows = f"f32[{length},8,256]"  # ys per chip: the batch is sharded 8 ways
    assert re.search(re.escape(rows) + r"\S* custom-call\(\), custom_call_target=\"AllocateBuffer\"", entry), entry
    assert not re.search(re.escape(rows) + r"\S* broadcast\(", entry), entry


def test_hbm_buffers_are_memory_space_0_of_the_buffer_assignment(tmp_path):
    from torch_xla_ext.tpu._client import hbm_buffer_bytes

    assert hbm_buffer_bytes(str(tmp_path)) is None
    (tmp_path / "module_0001.jit_f.cl_1.after_optimizations-buffer-assignment.txt").write_text(
        "BufferAssignment:\n"
        "allocation 0: size 4096, parameter 0, shape |f32[1024]| at ShapeIndex {}:\n"
        " value: <1 p0 @0> (size=4096,offset=0): f32[1024]{0}\n"
        "allocation 1: size 8192, maybe-live-out:\n"
        "allocation 2: size 1048576, color 1, preallocated-temp:\n"
        "allocation 3: size 512, color 0, preallocated-temp:\n"
        "allocation 4: size 64, color 4, preallocated-temp:\n")
    assert hbm_buffer_bytes(str(tmp_path)) == 4096 + 8192 + 512


def test_a_small_programs_peak_counts_on_chip_memory_its_hbm_buffers_do_not(device, mesh):
    # A small scan on v5e: the compiler prefetches layers into its on-chip vector memory (memory space
    # 1), and the peak it reports counts that; the program's HBM buffers are far smaller.
    r = _compiled_scan(device, mesh, 8)
    assert r.hbm_buffer_bytes is not None
    assert r.hbm_buffer_bytes < r.peak_bytes


def test_a_scan_lowered_with_the_cpu_choices_is_refused(device, mesh):
    with pytest.raises(ValueError, match=r"XLA:CPU-only choices \(scan_cpu_codegen.*tpu\.lowering\(\)"):
        tpu.compile(_scan_step(device, mesh, 2), topology="v5e:2x4")


def test_a_loop_of_unknown_trip_count_gets_no_flops(device):
    from torch._higher_order_ops.while_loop import while_loop

    import torch_xla.experimental.fori_loop  # noqa: F401  registers the XLA lowering

    start = torch.tensor(0, dtype=torch.int64, device=device)  # device data: the count is not in the program
    _, out = while_loop(lambda i, v: i < 5, lambda i, v: (i + 1, torch.sin(v) @ v), (start, torch.ones(8, 8, device=device)))
    r = tpu.compile(out, topology="v5e:2x4")
    assert r.trip_counts == (None,) and r.flops is None and r.bytes_accessed is None
    assert "trip count unknown" in str(r) and "not given" in str(r)


def test_refusals_come_before_anything_is_lowered(device, mesh):
    loss, *_ = _two_linear_step(device, mesh, width=64, batch=8)
    with pytest.raises(ValueError, match="does not know the topology 'v9z:1x1'.*v5p:2x2x2"):
        tpu.compile(loss, topology="v9z:1x1")
    with pytest.raises(ValueError, match="partitioned over 8 devices but v5e:2x2 has 4 chips"):
        tpu.compile(loss, topology="v5e:2x2")
    with pytest.raises(ValueError, match="must name a TPU slice"):
        tpu.compile(loss, topology="eight chips")
    with pytest.raises(TypeError, match="XLA tensor"):
        tpu.compile(torch.ones(2), topology="v5e:2x4")
    assert torch.isfinite(loss.cpu())  # the pending graph is untouched


def test_a_tensor_updated_in_place_reuses_its_buffer_when_donated(device, mesh):
    """``donated``: the updated weight is an aliased output, as torch_xla's sync donates it; bad pairs refused."""
    loss, w1, w2, x = _two_linear_step(device, mesh, width=256, batch=8)
    before = w1.clone()  # a tensor over w1's device data as it is before the update
    with torch.no_grad():
        w1 -= 0.1 * w1.grad
    kept = tpu.compile([loss], topology="v5e:2x4")
    donated = tpu.compile([loss], topology="v5e:2x4", donated=[(before, w1)])
    assert kept.alias_bytes == 0
    assert donated.alias_bytes == 256 * 256 * 4 // 8  # w1's shard per chip
    assert donated.output_bytes >= kept.output_bytes + 256 * 256 * 4 // 8  # w1 joined the outputs
    with pytest.raises(ValueError, match="a buffer is reused only by its own shape"):
        tpu.compile([loss], topology="v5e:2x4", donated=[(x, w1)])
    with pytest.raises(ValueError, match="not device data the program reads"):
        tpu.compile([loss], topology="v5e:2x4", donated=[(torch.zeros(256, 256, device=device), w1)])
    with pytest.raises(ValueError, match="a buffer or a result a second time"):
        tpu.compile([loss], topology="v5e:2x4", donated=[(before, w1), (before, w1)])
    with pytest.raises(TypeError, match=r"donated\[0\] must be a \(before, after\) pair"):
        tpu.compile([loss], topology="v5e:2x4", donated=[w1])


def test_rewriting_the_entry_keeps_every_constant(device):
    """XLA's default printer writes a 64-element constant as "{...}", which its parser reads back as another
    value; the entry rewrite (shardings, aliases) must keep the program's constants."""
    x = torch.ones(64, dtype=torch.int64).to(device)  # device data: a parameter
    y = x + torch.arange(64, device=device)  # a constant of the program
    ctx = txe.LoweringContext("constants")
    ctx.build([y])
    _, jaxlib_ext, xla_client = _tpu_client._jax()
    options = jaxlib_ext.HloPrintOptions()
    options.print_large_constants = True
    rewritten = _tpu_client.rewrite_entry(ctx.hlo(), {}, {0: ctx.tensor_parameter_id(x)})
    text = xla_client.XlaComputation(rewritten).get_hlo_module().to_string(options)
    assert "constant({" + ", ".join(str(n) for n in range(64)) + "})" in text
    assert "input_output_alias={ {0}: (" in text


def test_without_libtpu_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "libtpu", None)
    _tpu_client.topology_devices.cache_clear()
    try:
        with pytest.raises(tpu.TpuUnavailable, match=r"pip install -e '\.\[tpu\]'"):
            _tpu_client.topology_devices("v5e:2x4")
    finally:
        _tpu_client.topology_devices.cache_clear()


@pytest.mark.parametrize("name, closed", [
    ("v5p:4x4x4", (True, True, True)),  # one whole cube
    ("v5p:4x8x8", (True, True, True)),
    ("v5:4x4x4", (True, True, True)),  # libtpu's other name for v5p
    ("v4:4x4x8", (True, True, True)),
    ("v5p:2x4x4", (False, False, False)),  # less than a cube: a mesh
    ("v5p:2x2x2", (False, False, False)),
    ("v5e:16x16", (True, True, False)),  # a whole pod
    ("v5e:8x16", (False, True, False)),
    ("v6e:2x4", (False, False, False)),
    ("v5p:4xfour", (False, False, False)),  # malformed: libtpu refuses it, not this
])
def test_a_slice_closes_the_axes_its_real_links_close(name, closed):
    assert _tpu_client.wraparound(name) == closed


def test_a_slices_links_are_named_as_tpu_fit_prints_them():
    assert [_tpu_client.links(name) for name in ("v5p:4x4x4", "v5e:16x16", "v5e:8x16", "v5p:2x2x2")] == [
        "a 3-D torus", "a 2-D torus", "a ring on axis 2, a mesh otherwise", "a mesh"]


def test_a_whole_cube_is_compiled_for_as_the_torus_it_is():
    topologies, _, xla_client = _tpu_client._jax()

    def described(devices) -> bytes:  # libtpu's own record of the slice, links included
        return xla_client.get_topology_for_devices(list(devices)).serialize()

    with _tpu_client._quiet_stderr():
        mesh = topologies.get_topology_desc(topology_name="v5p:4x4x4", platform="tpu").devices
        torus = topologies.get_topology_desc(topology_name="v5p:4x4x4", platform="tpu", wrap=(True,) * 3).devices
    assert described(mesh) != described(torus)
    assert described(_tpu_client.topology_devices("v5p:4x4x4")) == described(torus)
    assert described(_tpu_client.topology_devices("v5p:2x2x2")) == described(
        topologies.get_topology_desc(topology_name="v5p:2x2x2", platform="tpu").devices)
