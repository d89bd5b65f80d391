#!/usr/bin/env python
"""Benchmark: transformers' Trainer on a prepared model (``hf.prepare`` + ``SPMDTrainer``) vs Trainer's own FSDPv2.

8 virtual CPU devices, SPMD, a Hugging Face Llama built from a config (no
download), the same rows for every method (left padding that varies by
row, the 2-D ``attention_mask`` Trainer's default collator gives), Trainer's
default arguments except ``max_steps``, ``learning_rate``, ``seed`` and
quiet logging. Methods:

  ours+scan   torch_xla_ext.hf.prepare(model, mesh) (fully_shard per decoder
              layer and at the root, the layers scanned, the mask built on the
              device) trained by torch_xla_ext.hf.SPMDTrainer
  ours+loop   the same with prepare(..., scan=False)
  fsdpv2      transformers.Trainer with fsdp="full_shard" and fsdp_config
              {"xla": True, "xla_fsdp_v2": True} wrapping each
              LlamaDecoderLayer (global mesh set), optim="adamw_torch" (its
              default fused AdamW has no XLA kernel), and the optimizer created
              after wrapping: transformers 5.23 leaves it None on that path
              ('NoneType' object has no attribute 'param_groups')
  ... bf16    the same three with TrainingArguments(bf16=True) (autocast; the
              model's default sdpa attention). Trainer's XLA FSDP path does
              not autocast: "fsdpv2 bf16" computes in float32 (its
              train_loss equals "fsdpv2"'s bit for bit), so its ratio
              compares a bfloat16 step with a float32 one
  trl ...     TRL's SFTTrainer with its defaults (bf16, gradient
              checkpointing) on the same rows as token ids:
              torch_xla_ext.hf.SPMDSFTTrainer on the prepared, scanned model,
              against SFTTrainer with the FSDPv2 arguments above; "-gc": both
              with gradient_checkpointing=False

A method that fails reports its error in place of its figures.

Each method runs in its own process; the processes alternate (ours+scan,
ours+loop, fsdpv2, then again) so drift of a shared machine hits all alike.
Per run it reports

  step      steady step time: wall time between Trainer's step starts, the
            median over the steps after the first four (Trainer syncs at each
            batch, so a step's time includes running the previous one)
  d2h/step  device->host transfers inside a steady step (torch_xla's
            TransferFromDeviceTime count), and gathers/step
            (ReplicateShardedData): FSDPv2 reads the 2-D mask on the host
  compiles  torch_xla compilations in the whole run
  loss      Trainer's train_loss (the methods train the same model on the
            same rows; they agree to float32 rounding)

and the ratio of each method's step time to its FSDPv2 counterpart's of the
same round (same precision, Trainer or TRL), then draws the step times as
bars (``--png``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

#: name -> (trainer: "ours" or "fsdpv2"; scanned; TRL's SFTTrainer; arguments beyond the common ones)
SETUPS = {
    "ours+scan": ("ours", True, False, {}),
    "ours+loop": ("ours", False, False, {}),
    "fsdpv2": ("fsdpv2", False, False, {}),
    "ours+scan bf16": ("ours", True, False, {"bf16": True}),
    "ours+loop bf16": ("ours", False, False, {"bf16": True}),
    "fsdpv2 bf16": ("fsdpv2", False, False, {"bf16": True}),
    "trl ours+scan": ("ours", True, True, {}),  # TRL's defaults: bf16, gradient checkpointing
    "trl fsdpv2": ("fsdpv2", False, True, {}),
    "trl ours+scan -gc": ("ours", True, True, {"gradient_checkpointing": False}),
    "trl fsdpv2 -gc": ("fsdpv2", False, True, {"gradient_checkpointing": False}),
}
METHODS = tuple(SETUPS)
#: each method's step time is compared with its FSDPv2 counterpart's of the same round
BASELINE = {m: next(b for b, (kind, _, sft, extra) in SETUPS.items()
                    if kind == "fsdpv2" and sft == SETUPS[m][2] and extra == SETUPS[m][3]) for m in METHODS}


def _child(method: str, layers: int, hidden: int, seq: int, batch: int, steps: int) -> dict:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("CPU_NUM_DEVICES", "8")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # Where flax is installed, xs.mark_sharding imports torchax, which renames PyTorch's privateuse1
    # backend for the process; Trainer's pinned-memory loader (FSDPv2's device loader) then fails. Neither
    # method uses torchax: keep it out, as the test suite does.
    sys.modules["torchax"] = None
    import time

    import numpy as np
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    import transformers

    transformers.logging.set_verbosity_error()
    xr.use_spmd()
    torch.zeros(1, device=torch_xla.device())
    mesh = xs.Mesh(np.arange(xr.global_runtime_device_count()), (xr.global_runtime_device_count(),), ("fsdp",))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=1024, max_position_embeddings=seq)
    model = transformers.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(batch * steps):
        ids = torch.randint(0, 1024, (seq,), generator=g)
        mask = torch.ones(seq, dtype=torch.long)
        mask[: i % 7] = 0
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.clone()})

    def counts() -> tuple[int, int, int]:
        transfers = met.metric_data("TransferFromDeviceTime")
        compiles = met.metric_data("CompileTime")
        return (0 if transfers is None else transfers[0], int(met.counter_value("ReplicateShardedData") or 0),
                0 if compiles is None else compiles[0])

    class Clock(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.begins: list[float] = []
            self.inside: list[tuple[int, int]] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.begins.append(time.perf_counter())
            self._counts = counts()

        def on_step_end(self, args, state, control, **kwargs):
            now = counts()
            self.inside.append((now[0] - self._counts[0], now[1] - self._counts[1]))

    clock = Clock()
    out = tempfile.mkdtemp()
    kind, scanned, sft, overrides = SETUPS[method]
    common = dict(output_dir=out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-3, seed=3,
                  report_to="none", disable_tqdm=True, save_strategy="no", logging_steps=steps, **overrides)
    extra: dict = {}
    if sft:
        import datasets
        import tokenizers
        import trl

        words = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(1024)}, unk_token="w0"))
        extra["processing_class"] = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="w1",
                                                                         eos_token="w2")
        rows = datasets.Dataset.from_dict({"input_ids": [r["input_ids"][r["attention_mask"] > 0].tolist()
                                                         for r in rows]})
        arguments = trl.SFTConfig
        common.update(max_length=seq)
    else:
        arguments = transformers.TrainingArguments
    if kind == "fsdpv2":
        xs.set_global_mesh(mesh)
        base = trl.SFTTrainer if sft else transformers.Trainer

        class FSDPv2Trainer(base):
            def _wrap_model(self, model, training=True, dataloader=None):
                wrapped = super()._wrap_model(model, training, dataloader)
                if training and wrapped is not model and self.optimizer is None:
                    self.create_optimizer(wrapped)
                return wrapped

        args = arguments(
            optim="adamw_torch", fsdp="full_shard",
            fsdp_config={"xla": True, "xla_fsdp_v2": True, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
            **common)
        trainer = FSDPv2Trainer(model=model, args=args, train_dataset=rows, callbacks=[clock], **extra)
    else:
        from torch_xla_ext.hf import SPMDSFTTrainer, SPMDTrainer, prepare

        prepare(model, mesh, scan=scanned)
        ours = SPMDSFTTrainer if sft else SPMDTrainer
        trainer = ours(model=model, args=arguments(**common), train_dataset=rows, callbacks=[clock], **extra)
    try:
        result = trainer.train()
    except Exception as e:  # reported in place of the figures
        return {"method": method, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"}
    gaps = [b - a for a, b in zip(clock.begins, clock.begins[1:])][4:]
    steady = clock.inside[4:]
    return {"method": method, "step": statistics.median(gaps), "loss": result.training_loss,
            "d2h": max(t for t, _ in steady), "gathers": max(g for _, g in steady), "compiles": counts()[2]}


def _run_child(method: str, a: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", method, "--layers", str(a.layers), "--hidden",
           str(a.hidden), "--seq", str(a.seq), "--batch", str(a.batch), "--steps", str(a.steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"method": method, "error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1][:90]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _png(path: str, rounds: list[dict[str, dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.6, 3.8))
    width = 0.8 / len(rounds)
    for r, results in enumerate(rounds):
        xs = [k + r * width for k in range(len(METHODS))]
        ax.bar(xs, [results[m].get("step", 0.0) * 1e3 for m in METHODS], width, label=f"round {r + 1}")
    ax.set_xticks([k + width * (len(rounds) - 1) / 2 for k in range(len(METHODS))],
                  [m + (" (failed)" if "error" in rounds[0][m] else "") for m in METHODS], rotation=20, ha="right")
    ax.set_ylabel("steady step (ms)")
    ax.set_title("Trainer: prepared model vs Trainer's FSDPv2 (8 CPU devices)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--png", default="bench_trainer.png")
    ap.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child, a.layers, a.hidden, a.seq, a.batch, a.steps)))
        return 0
    rounds = []
    print(f"Llama, {a.layers} layers, hidden {a.hidden}, batch {a.batch} x {a.seq} tokens, {a.steps} steps")
    print(f"{'round':>5} {'method':<15} {'step ms':>8} {'vs':>5} {'baseline':<12} {'d2h/step':>8} {'gath/step':>9} "
          f"{'compiles':>8} {'train_loss':>11}")
    for r in range(a.rounds):
        results = {m: _run_child(m, a) for m in METHODS}
        rounds.append(results)
        for m in METHODS:
            x, base = results[m], results[BASELINE[m]]
            if "error" in x:
                print(f"{r + 1:>5} {m:<15} failed: {x['error']}", flush=True)
                continue
            ratio = f"{x['step'] / base['step']:.2f}" if "step" in base else "-"
            print(f"{r + 1:>5} {m:<15} {x['step'] * 1e3:>8.1f} {ratio:>5} {BASELINE[m]:<12} {x['d2h']:>8} "
                  f"{x['gathers']:>9} {x['compiles']:>8} {x['loss']:>11.6f}", flush=True)
    if a.png:
        _png(a.png, rounds)
        print(f"wrote {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
