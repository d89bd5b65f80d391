"""What the Trainer and accelerate tests share: a CPU reference run, step counters, the shared run's pieces."""

from __future__ import annotations

import dataclasses
import pathlib

import torch
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import transformers

from torch_xla_ext.hf import SPMDTrainer

from child_process import run_surviving
from hf_tiny import arguments


@dataclasses.dataclass
class CPUReference:
    """What plain ``transformers.Trainer`` gave on the CPU (see :func:`cpu_reference`)."""

    losses: list[float]         # the logged training losses
    eval_losses: list[float]    # ``evaluate()``'s eval_loss for each dataset asked for, in order
    predictions: object         # ``predict()``'s logits (numpy), or None


_CPU_REFERENCE = """
import sys
sys.modules["torch_xla"] = None  # as on a machine without it: Trainer then runs on the CPU
sys.path.insert(0, sys.argv[1])
import torch, transformers
import hf_tiny
from hf_tiny import arguments, tiny
job = torch.load(sys.argv[2], weights_only=False)
args = arguments(job["out"], use_cpu=True, optim="adamw_torch", **job["overrides"])
collator = getattr(hf_tiny, job["collator"]) if job["collator"] else None
trainer = transformers.Trainer(model=tiny(job["kind"]), args=args, train_dataset=job["train"], data_collator=collator)
trainer.train()
assert trainer.args.device.type == "cpu" and next(trainer.model.parameters()).device.type == "cpu"
torch.save({"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "eval_losses": [trainer.evaluate(rows)["eval_loss"] for rows in job["evaluate"]],
            "predictions": trainer.predict(job["predict"]).predictions if job["predict"] else None},
           sys.argv[3])
"""


def cpu_reference(kind: str, output_dir: pathlib.Path, train: list, *, evaluate: tuple = (),
                  predict: list | None = None, collator: str | None = None, **overrides) -> CPUReference:
    """The same model trained by plain ``transformers.Trainer`` on the CPU, with the AdamW our run uses.

    It runs in a child process that cannot import torch_xla: in this one
    ``use_cpu=True`` still runs on the XLA device, and accelerate's state is
    shared by every Trainer of the process. ``collator``: the name of a collator in ``hf_tiny``.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    job, result = output_dir / "job.pt", output_dir / "reference.pt"
    torch.save({"kind": kind, "out": str(output_dir), "train": train, "evaluate": list(evaluate), "predict": predict,
                "collator": collator, "overrides": overrides}, job)
    run_surviving(output_dir, _CPU_REFERENCE, str(pathlib.Path(__file__).parent), str(job), str(result))
    return CPUReference(**torch.load(result, weights_only=False))


_CPU_SFT_REFERENCE = """
import sys
sys.modules["torch_xla"] = None  # as on a machine without it: TRL then trains on the CPU
sys.path.insert(0, sys.argv[1])
import datasets, torch, trl
from hf_tiny import lora_config, sft_arguments, tiny, tokenizer
job = torch.load(sys.argv[2], weights_only=False)
args = sft_arguments(job["out"], use_cpu=True, optim="adamw_torch", **job["overrides"])
trainer = trl.SFTTrainer(model=tiny(job["kind"]), args=args, processing_class=tokenizer(),
                         train_dataset=datasets.Dataset.from_dict({"text": job["train"]}),
                         eval_dataset=datasets.Dataset.from_dict({"text": job["eval"]}) if job["eval"] else None,
                         peft_config=lora_config() if job["lora"] else None)
trainer.train()
assert next(trainer.model.parameters()).device.type == "cpu"
torch.save(trainer.state.log_history, sys.argv[3])
"""


def cpu_sft_reference(kind: str, output_dir: pathlib.Path, train: list[str], *, evaluate: list[str] | None = None,
                      lora: bool = False, **overrides) -> list[dict]:
    """TRL's ``SFTTrainer`` log history for the same model and texts on the CPU, with the AdamW our run uses
    (``sft_arguments`` and ``overrides``; ``lora``: ``lora_config()`` as ``peft_config``), in a child process
    that cannot import torch_xla (see :func:`cpu_reference`)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    job, result = output_dir / "job.pt", output_dir / "history.pt"
    torch.save({"kind": kind, "out": str(output_dir), "train": train, "eval": evaluate, "lora": lora,
                "overrides": overrides}, job)
    run_surviving(output_dir, _CPU_SFT_REFERENCE, str(pathlib.Path(__file__).parent), str(job), str(result))
    return torch.load(result, weights_only=False)


def losses(trainer: transformers.Trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@dataclasses.dataclass
class Counts:
    """torch_xla's counters at one moment: device->host transfers, gathers, compiles, bytes to the host."""

    d2h: int = 0
    gathers: int = 0
    compiles: int = 0
    d2h_bytes: int = 0

    @staticmethod
    def now() -> Counts:
        def metric(name: str, field: int) -> int:
            data = met.metric_data(name)
            return 0 if data is None else int(data[field])

        return Counts(metric("TransferFromDeviceTime", 0), int(met.counter_value("ReplicateShardedData") or 0),
                      metric("CompileTime", 0), metric("InboundData", 1))

    def __sub__(self, other: Counts) -> Counts:
        return Counts(*(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(Counts)))


def programs_run() -> int:
    """How many programs torch_xla has run so far, counting every one already launched.

    ``torch_xla.sync()`` returns before its program runs, and the
    ``ExecuteReplicated`` counter moves once it has run, on a thread of the
    runtime; so a window opened right after a step could count that step's
    program, or not, by timing. Waiting for the device first (which moves no
    data) closes that race.
    """
    xm.wait_device_ops()
    return int(met.counter_value("ExecuteReplicated") or 0)


class StepCounts(transformers.TrainerCallback):
    """Per training step: what moved inside it (``inside``), and the counters when each step began (``at_begin``).

    Trainer logs (reading the loss) after a step ends, so ``inside`` is the
    step itself; compiles happen when the next batch is fetched, between steps,
    so they are read from ``at_begin``.
    """

    def __init__(self) -> None:
        self.inside: list[Counts] = []
        self.at_begin: list[Counts] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._begin = Counts.now()
        self.at_begin.append(self._begin)

    def on_step_end(self, args, state, control, **kwargs):
        self.inside.append(Counts.now() - self._begin)


class CountedTrainer(SPMDTrainer):
    """``SPMDTrainer`` that records what each checkpoint save and load moved (``windows``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.windows: dict[str, list[Counts]] = {}

    def _counted(self, name, call, *args, **kwargs):
        before = Counts.now()
        result = call(*args, **kwargs)
        self.windows.setdefault(name, []).append(Counts.now() - before)
        return result

    def _save_checkpoint(self, *args, **kwargs):
        return self._counted("save", super()._save_checkpoint, *args, **kwargs)

    def _load_from_checkpoint(self, *args, **kwargs):
        return self._counted("load_model", super()._load_from_checkpoint, *args, **kwargs)

    def _load_optimizer_and_scheduler(self, *args, **kwargs):
        return self._counted("load_optimizer", super()._load_optimizer_and_scheduler, *args, **kwargs)


RUN_STEPS, SAVE_EVERY = 6, 3


def run_arguments(output_dir) -> transformers.TrainingArguments:
    """The shared run's arguments: Trainer's defaults, every step logged, a checkpoint every 3 steps."""
    return arguments(output_dir, max_steps=RUN_STEPS, logging_steps=1, save_steps=SAVE_EVERY)


def host_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


@dataclasses.dataclass
class TrainedRun:
    trainer: CountedTrainer
    steps: StepCounts
    final: dict[str, torch.Tensor]  # the parameters when training ended
    out: object  # the output directory (pathlib.Path)
    rows: list
