"""What the Trainer and accelerate tests share: tiny models, token datasets, a CPU reference run, step counters."""

from __future__ import annotations

import dataclasses

import torch
import torch_xla.debug.metrics as met
import transformers

from torch_xla_ext.hf import SPMDTrainer

VOCAB = 128


def tiny(kind: str) -> torch.nn.Module:
    """A seeded tiny causal LM: ``llama``, ``gpt2`` (head tied to the embedding) or ``gemma2`` (interleaved)."""
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=VOCAB, n_positions=64,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config)
    if kind == "llama":
        config = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
        return transformers.LlamaForCausalLM(config)
    config = transformers.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, max_position_embeddings=64, sliding_window=4, attn_implementation="eager")
    return transformers.Gemma2ForCausalLM(config)


def token_rows(count: int, seq: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Rows as a tokenized dataset gives them to the default collator: left padding that varies by row."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(count):
        ids = torch.randint(0, VOCAB, (seq,), generator=g)
        mask = torch.ones(seq, dtype=torch.long)
        mask[: i % 5] = 0
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.clone()})
    return rows


def arguments(output_dir, **overrides) -> transformers.TrainingArguments:
    """Trainer's defaults, quiet, with a learning rate that moves a tiny model (and any override)."""
    values = dict(output_dir=str(output_dir), report_to="none", disable_tqdm=True, learning_rate=1e-2, seed=3)
    values.update(overrides)
    return transformers.TrainingArguments(**values)


def cpu_reference(kind: str, output_dir, train, **overrides) -> transformers.Trainer:
    """The same model trained by plain ``transformers.Trainer`` on the CPU, with the AdamW our run uses."""
    args = arguments(output_dir, use_cpu=True, optim="adamw_torch", **overrides)
    trainer = transformers.Trainer(model=tiny(kind), args=args, train_dataset=train)
    trainer.train()
    return trainer


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
