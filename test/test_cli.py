"""python -m torch_xla_ext demo / audit."""

from __future__ import annotations

import os
import re

import torch
import torch_xla

import torch_xla_ext as txe
from torch_xla_ext.cli.main import main
from torch_xla_ext._cpu_threads import _cores

from child_process import run_child


def test_demo_runs_on_default_cpu_devices():
    # Unset as for a user who chose nothing (importing torch_xla here set TF_CPP_MIN_LOG_LEVEL=1).
    proc = run_child(["-m", "torch_xla_ext", "demo", "--layers", "2", "--width", "64", "--steps", "2"], devices=None,
                     unset=("PJRT_DEVICE", "CPU_NUM_DEVICES", "PJRT_NPROC", "TF_CPP_MIN_LOG_LEVEL"))
    # XLA's C++ warnings are hidden by default (one per SPMD compilation otherwise).
    assert "GSPMD sharding propagation" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    out = proc.stdout
    assert "8 devices (PJRT_DEVICE=CPU, CPU_NUM_DEVICES=8" in out
    assert ("PJRT_NPROC=16" in out) == (_cores() < 16)  # twice the devices on a machine with fewer cores
    # The parameter table: one row per HLO parameter, one RNG seed, one input, the rest hoisted weights.
    declared = int(re.search(r"HLO module .*?(\d+) parameters", out).group(1))
    kinds = [line.split()[-1] for line in out.splitlines() if re.match(r"\d+\s+p\d+", line)]
    assert len(kinds) == declared >= 3, out
    assert kinds.count("seed") == 1 and kinds.count("input") == 1 and kinds.count("hoisted") == declared - 2, kinds
    host = next(line for line in out.splitlines() if line.startswith("host mapping"))
    device = next(line for line in out.splitlines() if line.startswith("device mapping"))
    assert "0 B" in device.split("ms", 1)[1]  # nothing moved to the host
    assert "0 B" not in host.split("ms", 1)[1]
    assert "under no_host_transfers(): ok" in out
    assert "outputs and gradients equal the unrolled loop: True" in out  # scan_layers section
    assert "2 while loops" in out
    assert "tied weight kept: True" in out  # fully_shard section
    assert "bytes moved device->host inside the training steps: 0;" in out
    assert "every gradient sharded like its parameter: True" in out
    # Not a terminal: one progress line per step, no carriage returns.
    assert "\r" not in out
    assert [n for n in re.findall(r"step (\d+)/2 ", out)] == ["1", "2"], out
    first, last = map(float, re.search(r"^loss (\S+) -> (\S+);", out, re.M).groups())
    assert last < first  # the sharded training steps do update the weights
    # The TPU section (the test extra installs libtpu): the step compiled for v5p:2x2x2, fits.
    tpu_section = out.split("TPU fit check", 1)[1]
    assert re.search(r"^topology\s+v5p:2x2x2 \(8 x TPU v5", tpu_section, re.M), tpu_section
    assert re.search(r"^fits\s+yes$", tpu_section, re.M) and "peak per chip" in tpu_section, tpu_section
    # The updated parameters reuse their buffers, as the job's sync donates them.
    aliased = re.search(r"^outputs\s+.*\((.*) aliased\)$", tpu_section, re.M)
    assert aliased and aliased.group(1) != "0 B", tpu_section


def test_cli_hides_xla_warnings_unless_the_user_set_a_level(monkeypatch):
    from torch_xla_ext.cli.demo import default_xla_log_level

    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    default_xla_log_level()
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0"  # the user's choice, unchanged
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL")
    default_xla_log_level()
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "2"  # INFO and WARNING hidden, ERROR kept


def test_audit_reports_a_saved_module(tmp_path, capsys, device):
    a = torch.randn(4, 4, generator=torch.Generator().manual_seed(0)).to(device)
    torch_xla.sync()
    ctx = txe.LoweringContext("audited")
    ctx.build([a @ a + 1.5])
    path = tmp_path / "module.pb"
    path.write_bytes(ctx.hlo())
    assert main(["audit", str(path)]) == 0
    out = capsys.readouterr().out
    assert "audited" in out and "f32[4,4]" in out


def test_audit_rejects_garbage(tmp_path, capsys):
    path = tmp_path / "garbage.pb"
    path.write_bytes(b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff")
    assert main(["audit", str(path)]) == 2
    assert "not a valid serialized HloModuleProto" in capsys.readouterr().err
    assert main(["audit", str(tmp_path / "missing.pb")]) == 2
    assert "cannot read" in capsys.readouterr().err
