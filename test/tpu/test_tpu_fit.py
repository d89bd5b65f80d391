"""tpu_fit: a training step lowered from shapes is the step lowered from real tensors, for the TPU compiler.

The shape-only step (placeholders for every parameter, moment and token)
must compile to the same per-chip figures as the same step over real
tensors, and a step lowered for 8 devices and widened to a 16-chip slice to
those of the step lowered for 16: that is what makes a 70B figure from this
machine the real job's figure. Each lowering runs in a child process (a
device count per process; placeholders must never be executed).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import textwrap

import pytest

from torch_xla_ext.tpu_fit import FitReport

from child_process import run_child, run_surviving

pytest.importorskip("libtpu")

SMALL = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128}
# Every figure the TPU compiler gives per chip, compile time aside.
FIGURES = ("peak_bytes", "argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "generated_code_bytes",
           "flops", "bytes_accessed", "collectives", "trip_counts", "fits")


def _steps(devices: int, calls: list[dict]) -> list[dict]:
    """Run ``compile_step(**call)`` for each call in one child process with ``devices`` CPU devices.

    A real step after a shape-only one executes a step in the process that lowered placeholders: it
    crashed while a placeholder's record held its parameter, and with it the step's graph, alive.
    """
    source = textwrap.dedent(f"""
        import dataclasses, json, os, sys
        from torch_xla_ext import _placeholders
        from torch_xla_ext.tpu_fit import compile_step
        for call in json.loads({json.dumps(json.dumps(calls))}):
            print(json.dumps(dataclasses.asdict(compile_step(**call))), flush=True)
        print("placeholders left:", len(_placeholders._marked), flush=True)
        os._exit(0)
    """)
    proc = run_child(["-c", source], devices=devices, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert "placeholders left: 0" in proc.stdout  # each shape-only step's model, and its graph, went with it
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tpu_fit") / "config.json"
    path.write_text(json.dumps(SMALL))
    return str(path)


def _answer(command, request, env, deadline, limit, tick, started, phase):
    """Start ``command`` as fit starts a child, hand it ``request`` and watch it to its answer."""
    from torch_xla_ext.tpu.fit import _Child

    with _Child(command, env) as child:
        return child.answer(request, deadline, limit, tick, started, phase)


def _call(config, topology, path, from_shapes=True, batch=16, seq=32):
    return {"config": config, "topology": topology, "batch": batch, "seq": seq, "path": path,
            "from_shapes": from_shapes}


def test_shape_only_step_compiles_to_the_real_steps_figures(config_file):
    """Loop, scan and stacked scan: placeholders give the real tensors' figures exactly; widening 8 -> 16 gives
    the 16's."""
    steps = _steps(8, [_call(config_file, "v5e:2x4", "loop"), _call(config_file, "v5e:2x4", "scan"),
                       _call(config_file, "v5p:2x2x4", "scan"), _call(config_file, "v5e:2x4", "scan+stacked"),
                       _call(config_file, "v5e:2x4", "loop", from_shapes=False),
                       _call(config_file, "v5e:2x4", "scan", from_shapes=False),
                       _call(config_file, "v5e:2x4", "scan+stacked", from_shapes=False)])
    shapes, real = steps[:4], steps[4:]
    (native,) = _steps(16, [_call(config_file, "v5p:2x2x4", "scan")])
    for got, want in ((shapes[0], real[0]), (shapes[1], real[1]), (shapes[2], native), (shapes[3], real[2])):
        assert got["path"] == want["path"]
        assert {k: got["compiled"][k] for k in FIGURES} == {k: want["compiled"][k] for k in FIGURES}
    assert (shapes[2]["lowered_on"], shapes[2]["chips"], native["lowered_on"]) == (8, 16, 16)

    # Hand count: every parameter and both AdamW moments (fp32, sharded evenly) are donated, that is aliased;
    # the TPU's tiled layouts may pad a small shard, never shrink one. The tokens are not donated.
    n = shapes[0]["parameters"]
    for report in shapes:
        compiled = report["compiled"]
        assert compiled["alias_bytes"] >= 3 * 4 * n // report["chips"]
        assert compiled["argument_bytes"] >= compiled["alias_bytes"] + 8 * 16 * 32 // report["chips"]
        assert compiled["trip_counts"] == ([] if report["path"] == "loop" else [2, 2])
        assert compiled["fits"] and report["host_rss_bytes"] > 0
        # What the step needs is its HBM as the buffer assignment places it, split by kind to the byte.
        parts = FitReport(**report).breakdown()
        assert sum(parts.values()) == FitReport(**report).required_bytes == (
            compiled["hbm_buffer_bytes"] + compiled["generated_code_bytes"])
        assert parts["parameters"] >= 4 * n // report["chips"] and parts["temporaries (gradients, activations)"] > 0
        assert abs(parts["optimizer moments"] - 2 * parts["parameters"]) <= 2


def test_a_shape_only_step_that_raised_leaves_nothing_that_a_later_sync_would_execute(config_file, tmp_path):
    # The caller keeps the error (as pytest.raises does): its traceback held the failed step's locals,
    # and a sync then executed their graph over placeholders (a segmentation fault).
    source = textwrap.dedent(f"""
        import os, torch, torch_xla
        from torch_xla_ext import _placeholders, tpu, tpu_fit

        def refuse(*args, **kwargs):
            raise RuntimeError("no compile today")

        tpu._compile_lowered = refuse
        try:
            tpu_fit.compile_step({config_file!r}, "v5e:2x4", batch=16, seq=32, path="loop")
        except RuntimeError as error:
            kept = error
        print("placeholders left:", len(_placeholders._marked), flush=True)
        print("executed:", (torch.arange(4.0, device=torch_xla.device()) * 2).sum().item(), flush=True)
        os._exit(0)
    """)
    out = run_surviving(tmp_path, source)
    assert "placeholders left: 0" in out and "executed: 12.0" in out, out


def test_the_compile_child_never_imports_torch_and_its_program_gives_the_in_process_figures(config_file, tmp_path):
    """fit's second child: the compiler's host memory does not sit on top of torch's, and the program it hands
    back describes as the same step compiled where it was lowered."""
    from torch_xla_ext.tpu import _described
    from torch_xla_ext.tpu._compile_child import read_answer
    from torch_xla_ext.tpu.fit import _COMPILE_CHILD

    program = tmp_path / "step.hlo.pb"
    lowered, in_process = _steps(8, [{**_call(config_file, "v5e:2x4", "scan"), "hlo_to": str(program)},
                                     _call(config_file, "v5e:2x4", "scan")])
    assert lowered["compiled"] is None and lowered["host_rss_bytes"] > 0 and program.stat().st_size > 0
    compiled_to = str(tmp_path / "compiled")
    source = textwrap.dedent(f"""
        import io, json, runpy, sys
        child = runpy.run_path({_COMPILE_CHILD!r})  # its functions; main() is not run
        sys.stdin = io.StringIO(json.dumps({{"hlo": {str(program)!r}, "topology": "v5e:2x4",
                                             "program_to": {compiled_to!r}}}))
        child["main"]()
        print("torch imported:", "torch" in sys.modules, flush=True)
    """)
    proc = run_child(["-P", "-c", source], devices=None, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert "torch imported: False" in proc.stdout, proc.stdout
    answer = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert answer["host_rss_bytes"] > 0
    described = _described(read_answer(answer, compiled_to), program.read_bytes(), "v5e:2x4")
    figures = json.loads(json.dumps(dataclasses.asdict(described)))  # as the in-process step's came: JSON
    assert {k: figures[k] for k in FIGURES} == {k: in_process["compiled"][k] for k in FIGURES}


def test_a_step_the_compiler_refuses_for_hbm_comes_back_from_the_compile_child_as_not_fitting(device, tmp_path):
    import os
    import time

    import torch

    from torch_xla_ext import tpu
    from torch_xla_ext.tpu._compile_child import read_answer
    from torch_xla_ext.tpu.fit import _COMPILE_CHILD

    drawn = torch.rand(17 * (1 << 30) // 4, device=device)  # a 17 GiB temporary on a 16 GiB chip
    program = tmp_path / "step.hlo.pb"
    program.write_bytes(tpu._lower([drawn.sum() + drawn.max()], "v5e:2x4", (), widen=False))
    del drawn  # dies here: no later sync runs it
    compiled_to = str(tmp_path / "compiled")
    now = time.monotonic()
    answer, error = _answer([sys.executable, "-P", _COMPILE_CHILD],
                            {"hlo": str(program), "topology": "v5e:2x4", "program_to": compiled_to},
                            {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, now + 300, 1 << 40, None, now, "compiling")
    assert error is None and answer["memory"] is None and "RESOURCE_EXHAUSTED" in answer["refusal"], answer
    assert not os.path.exists(compiled_to + ".pb")
    r = tpu._described(read_answer(answer, compiled_to), program.read_bytes(), "v5e:2x4")
    assert not r.fits and r.error == answer["refusal"] and r.chips == 8


def test_a_compile_child_that_fails_or_runs_past_the_deadline_is_an_error_not_an_answer(tmp_path):
    import os
    import time

    from torch_xla_ext.tpu.fit import _COMPILE_CHILD

    program = tmp_path / "step.hlo.pb"
    program.write_bytes(b"not a program")
    request, env = {"hlo": str(program), "topology": "v5e:2x4"}, {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    now = time.monotonic()
    answer, error = _answer([sys.executable, "-P", _COMPILE_CHILD], request, env, now + 300, 1 << 40, None, now,
                           "compiling")
    assert answer is None and error.startswith("the step did not lower or compile: ") and "Error" in error, error
    answer, error = _answer([sys.executable, "-P", _COMPILE_CHILD], request, env, now - 1, 1 << 40, None, now - 7,
                           "compiling")
    assert (answer, error) == (None, "stopped after 6 s")


def test_cli_prints_a_table_and_writes_a_png(config_file, tmp_path):
    png = tmp_path / "fit.png"
    proc = run_child(["-m", "torch_xla_ext", "tpu-fit", "--config", config_file, "--topology", "v5e:2x2",
                      "--batch", "4", "--seq", "32", "--paths", "scan+nothing_saveable", "--png", str(png)],
                     devices=None)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("v5e:2x2 (a mesh): 4 chips x 16.0 GiB HBM; batch 4 x 32 tokens;")
    row = next(line for line in lines if line.startswith("scan+nothing_saveable"))
    assert row.split()[1] == "yes" and "reduce-scatter" in row
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Progress on stderr (not a terminal here: a line per phase), and nothing else (no log spam).
    phases = [re.sub(r" \(\d+ s\)$", "", line) for line in proc.stderr.splitlines()]
    assert phases == [f"[1/1] scan+nothing_saveable: {phase}" for phase in
                      ("starting", "building the model", "lowering the step", "compiling for v5e:2x2", "done")], proc.stderr


@pytest.mark.parametrize("args, message, imported", [
    (["--topology", "v5q:9x9"], "does not know the topology", False),
    (["--config", "no-such-model-type"], "ships no config for 'no-such-model-type'", True),
    (["--config", "vit"], "has no causal language model class", True),
    (["--paths", "scan+flash"], "unknown path 'scan+flash'", False),
    (["--batch", "0"], "batch must be a positive int", False),
])
def test_cli_refuses_bad_arguments_before_a_child_is_handed_work(config_file, args, message, imported, capsys,
                                                                 monkeypatch):
    """The topology, paths and sizes are checked before any child starts; the config is read while the first
    child imports, and a config refused kills that child before it is handed a request."""
    from torch_xla_ext import tpu_fit
    from torch_xla_ext.cli.main import main

    started = []

    class Importing:  # what fit sees of a child: this one only records what fit does with it
        def __init__(self, command, env):
            self.closed = False
            started.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            self.close()

        def close(self):
            self.closed = True

        def answer(self, *args):
            raise AssertionError("a child was handed a request")

    monkeypatch.setattr(tpu_fit, "_Child", Importing)
    base = {"--config": config_file, "--topology": "v5e:2x2", "--batch": "4", "--seq": "32"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    assert main(["tpu-fit", *[word for pair in base.items() for word in pair]]) == 2
    out, err = capsys.readouterr()
    assert message in err and out == ""
    assert [child.closed for child in started] == ([True] if imported else [])


def test_a_compiled_step_this_process_cannot_read_is_that_paths_error(config_file, monkeypatch):
    from torch_xla_ext import tpu_fit

    def unreadable(answer, program_to):
        raise ValueError("a truncated program")

    monkeypatch.setattr(tpu_fit, "read_answer", unreadable)
    (report,) = tpu_fit.fit(config_file, "v5e:2x2", batch=4, seq=32, paths=["scan"])
    assert report.compiled is None and report.parameters > 0
    assert report.error == "the compiled step could not be read: ValueError: a truncated program"


def _recording_children(monkeypatch) -> list:
    """Make fit's children record themselves in the list returned."""
    from torch_xla_ext import tpu_fit

    started = []

    class Recorded(tpu_fit._Child):
        def __init__(self, command, env):
            super().__init__(command, env)
            started.append(self)

    monkeypatch.setattr(tpu_fit, "_Child", Recorded)
    return started


def test_a_config_refused_kills_the_child_that_was_importing(monkeypatch):
    from torch_xla_ext import tpu_fit

    started = _recording_children(monkeypatch)
    with pytest.raises(ValueError, match="has no causal language model class"):
        tpu_fit.fit("vit", "v5e:2x2", batch=4, seq=32, paths=["scan"])
    # Killed by fit as it raised (the child imports for seconds before it would read a request).
    assert [child.proc.returncode for child in started] == [-9]


def test_a_progress_callback_that_raises_at_the_start_kills_the_child_that_was_importing(monkeypatch, config_file):
    from torch_xla_ext import tpu_fit

    def interrupted(path, phase, seconds):  # as a notebook's interrupt lands in the callback
        raise KeyboardInterrupt

    started = _recording_children(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        tpu_fit.fit(config_file, "v5e:2x2", batch=4, seq=32, paths=["scan"], progress=interrupted)
    assert [child.proc.returncode for child in started] == [-9]


def test_a_placement_that_depends_on_the_device_count_is_refused():
    """A slice of 128+ chips is lowered on fewer devices: a parameter placed otherwise there is refused."""
    import torch

    from torch_xla_ext.distributed import fully_shard
    from torch_xla_ext.tpu._fit_step import _check_placements

    model = fully_shard(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)))
    _check_placements(model, 8, 16)  # 16 divides over 8 and over 16: dim 0 both times
    with pytest.raises(ValueError, match=r"0\.weight \(16, 16\) is sharded on dim 0 over 8 devices but would "
                                         r"be replicated over 32"):
        _check_placements(model, 8, 32)


def test_the_table_shows_a_refused_step_by_what_the_compiler_says_it_needs_and_a_stopped_one_by_why():
    from torch_xla_ext.cli.tpu_fit import report_table

    gib = 1 << 30
    fields = dict(topology="v5p:8x8x4", device_kind="TPU v5", chips=256, hbm_bytes=95 * gib, fits=False,
                  peak_bytes=0, argument_bytes=0, output_bytes=0, alias_bytes=0, temp_bytes=0,
                  generated_code_bytes=0, flops=None, bytes_accessed=None, while_loops=0, compile_seconds=140.0,
                  collectives={}, trip_counts=[],
                  error="RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
                        "hbm. Used 223.23G of 95.74G hbm. Exceeded hbm capacity by 127.49G.")
    refused = FitReport("scan", "v5p:8x8x4", 256, 256, 2048, fields, 3 * gib, 7.0, 70_553_706_496, 64)
    stopped = FitReport("loop", "v5p:8x8x4", 256, 256, 2048, None, 0, 0.0, 0, 64,
                        error="stopped at 16.0 GiB of host memory, 412 s in")
    assert refused.required_bytes == int(223.23 * gib) and not refused.fits and not stopped.fits
    lines = report_table([refused, stopped]).splitlines()
    assert lines[0] == ("v5p:8x8x4 (a 3-D torus): 256 chips x 95.0 GiB HBM; batch 256 x 2048 tokens; "
                        "70.55B parameters; lowered on 64 virtual devices")
    scan_row, loop_row = lines[3].split(), lines[4].split()
    assert scan_row[:6] == ["scan", "NO", "223.2", "GiB", "235.0%", "-128.2"]
    assert lines[3].endswith("Exceeded hbm capacity by 127.49G.")
    assert loop_row[:2] == ["loop", "-"] and lines[4].endswith("stopped at 16.0 GiB of host memory, 412 s in")


def test_a_config_is_a_model_type_a_json_file_or_a_folder(tmp_path, config_file):
    from torch_xla_ext.tpu_fit import load_config

    assert load_config("llama").model_type == "llama"
    assert load_config(config_file).hidden_size == SMALL["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    assert load_config(tmp_path).num_hidden_layers == SMALL["num_hidden_layers"]
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="not a transformers config.json"):
        load_config(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="cannot read the config file"):
        load_config(str(tmp_path / "missing.json"))


def test_progress_on_a_terminal_is_one_line_rewritten_at_most_once_a_second():
    import io

    from torch_xla_ext.cli.tpu_fit import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    progress = Progress(["loop", "scan"], stream)
    for seconds in (0.0, 0.2, 0.4, 1.1):
        progress("loop", "lowering the step", seconds)
    progress("loop", "done", 1.3)
    assert stream.getvalue() == ("\r\033[K[1/2] loop: lowering the step (0 s)\r\033[K[1/2] loop: lowering the step (1 s)"
                                 "\r\033[K[1/2] loop: done (1 s)\n")


def test_a_child_killed_by_a_signal_is_named_in_the_error():
    import os
    import time

    now = time.monotonic()
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}

    def killed(sig: str, note: str = "") -> str:
        source = f"import os, signal, sys; sys.stdin.read(); print({note!r}, file=sys.stderr, flush=True); " \
                 f"os.kill(os.getpid(), signal.{sig})"
        answer, error = _answer([sys.executable, "-c", source], {}, env, now + 300, 1 << 40, None, now, "compiling")
        assert answer is None
        return error

    assert killed("SIGKILL", "a log line from before") == (
        "the step did not lower or compile: killed by SIGKILL, as the kernel's out-of-memory killer does when the "
        "machine runs out of memory before the path's host-memory limit stops it")
    assert killed("SIGABRT", "F1128 hlo.cc:12] Check failed: x") == (
        "the step did not lower or compile: killed by SIGABRT: F1128 hlo.cc:12] Check failed: x")
    assert killed("SIGSEGV") == "the step did not lower or compile: killed by SIGSEGV"


def _writes_its_pid_then_sleeps(pid_file) -> str:
    """Python source: write this process's pid and a newline to ``pid_file``, then sleep for ten minutes."""
    return f"import os, time; open({str(pid_file)!r}, 'w').write(f'{{os.getpid()}}\\n'); time.sleep(600)"


def _written_pid(pid_file) -> int | None:
    """The pid :func:`_writes_its_pid_then_sleeps` wrote, once written whole; None before."""
    text = pid_file.read_text() if pid_file.exists() else ""
    return int(text) if text.endswith("\n") else None


def _parent_module_alone() -> str:
    """Python source that loads ``torch_xla_ext.tpu._parent`` by its path (no package, no torch) as ``m``."""
    from torch_xla_ext.tpu import _parent

    return (f"import importlib.util; spec = importlib.util.spec_from_file_location('p', {_parent.__file__!r}); "
            f"m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); ")


def test_a_child_is_killed_when_watching_it_raises_and_one_that_exits_unread_is_an_error(tmp_path):
    import os
    import time

    now = time.monotonic()
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    pid_file = tmp_path / "pid"

    def interrupted(phase: str, seconds: float) -> None:  # as a notebook's interrupt lands in the poll loop
        if _written_pid(pid_file) is not None:
            raise KeyboardInterrupt

    sleeper = [sys.executable, "-c", "import sys; sys.stdin.read(); " + _writes_its_pid_then_sleeps(pid_file)]
    with pytest.raises(KeyboardInterrupt):
        _answer(sleeper, {}, env, now + 300, 1 << 40, interrupted, now, "compiling")
    pid = _written_pid(pid_file)
    assert pid is not None and not os.path.exists(f"/proc/{pid}"), "the child outlived the interrupted watch"

    big = {"pad": "x" * (1 << 20)}  # more than a pipe holds: the write meets the pipe the child closed
    answer, error = _answer([sys.executable, "-c", "import sys; sys.exit('no request wanted')"], big, env, now + 300,
                           1 << 40, None, now, "compiling")
    assert (answer, error) == (None, "the step did not lower or compile: no request wanted")


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie no one has reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_child_dies_with_its_parent_even_when_the_parent_is_killed(tmp_path):
    """A parent killed outright (SIGKILL, or the SIGTERM of `timeout`) runs no cleanup: the kernel kills its
    child, which asked for that (torch_xla_ext.tpu._parent)."""
    import os
    import signal
    import subprocess
    import time

    pid_file = tmp_path / "child_pid"
    child = (_parent_module_alone() + "import os; assert m.exit_with_parent(os.getppid()); "
             + _writes_its_pid_then_sleeps(pid_file))
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time; "
                                                     f"subprocess.Popen([sys.executable, '-P', '-c', {child!r}]); "
                                                     f"time.sleep(600)"])
    try:
        for _ in range(600):
            if _written_pid(pid_file) is not None:
                break
            time.sleep(0.05)
        pid = _written_pid(pid_file)
        assert pid is not None and not _gone(pid)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    for _ in range(200):
        if _gone(pid):
            break
        time.sleep(0.05)
    outlived = not _gone(pid)
    if outlived:  # not left sleeping, holding the run's output open, when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not outlived, "the child outlived its killed parent"


@pytest.mark.parametrize("child", ["lowering", "compiling"])
def test_a_child_whose_parent_died_before_it_started_watching_exits_at_once(child, tmp_path):
    import os
    import subprocess

    from torch_xla_ext.tpu._parent import ORPHAN_EXIT_STATUS, PARENT_KEY
    from torch_xla_ext.tpu.fit import _COMPILE_CHILD

    command = ([sys.executable, "-m", "torch_xla_ext.tpu._fit_step"] if child == "lowering"
               else [sys.executable, "-P", _COMPILE_CHILD])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # exited and reaped: as fit would be had it died before the child looked
    request = {"hlo": str(tmp_path / "absent.pb"), "config": {}, "topology": "v5e:2x4", "batch": 1, "seq": 1,
               "path": "scan", PARENT_KEY: gone.pid}
    proc = subprocess.run(command, input=json.dumps(request), capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert (proc.returncode, proc.stdout) == (ORPHAN_EXIT_STATUS, ""), proc.stderr[-2000:]
    assert f"process {gone.pid}, which started this one, is gone: exiting" in proc.stderr


def test_a_child_started_through_a_launcher_goes_on_while_the_process_that_started_it_lives():
    """sys.executable may be a launcher that starts python as its child: the parent is then not fit's process."""
    import os
    import subprocess

    child = _parent_module_alone() + f"m.exit_with_parent({os.getpid()}); print('went on')"
    launcher = [sys.executable, "-c", f"import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', "
                                      f"{child!r}]))"]
    proc = subprocess.run(launcher, capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stdout.strip()) == (0, "went on"), proc.stderr[-2000:]
