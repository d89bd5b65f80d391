"""Tiny Hugging Face models, token rows and Trainer arguments, importable without torch_xla.

The Trainer tests' CPU reference runs in a process that cannot import
torch_xla (where it can, ``TrainingArguments(use_cpu=True)`` still puts the
model on the XLA device); it builds its model and rows from here.
"""

from __future__ import annotations

import torch
import transformers

VOCAB = 128


#: The rotary decoders, one size: (config class, model class, what differs from the class's defaults).
_ROTARY = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": False}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
}


#: The mixture-of-experts decoders: (config class, model class, their sizes), 4 experts, 2 per token.
_MOE = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                {"num_local_experts": 4, "intermediate_size": 96, "sliding_window": None}),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  {"num_experts": 4, "intermediate_size": 96, "moe_intermediate_size": 48, "head_dim": 16}),
}


def tiny(kind: str) -> torch.nn.Module:
    """A seeded tiny causal LM: ``llama``, ``qwen2``, ``mistral`` (rotary, ``sdpa`` attention), ``mixtral``,
    ``qwen3_moe`` (mixture of experts), ``gpt2`` (head tied to the embedding) or ``gemma2`` (interleaved,
    ``eager`` attention)."""
    torch.manual_seed(0)
    if kind in _MOE:
        config_class, model_class, own = _MOE[kind]
        return model_class(config_class(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=64, **own))
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=VOCAB, n_positions=64,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config)
    if kind in _ROTARY:
        config_class, model_class, own = _ROTARY[kind]
        return model_class(config_class(
            hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, **own))
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


def ragged_rows(count: int, lengths: tuple[int, ...], seed: int = 2) -> list[dict[str, torch.Tensor]]:
    """Rows of unpadded token ids, their lengths cycling through ``lengths``, as a tokenized dataset gives them."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(count):
        ids = torch.randint(0, VOCAB, (lengths[i % len(lengths)],), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def pad_batch(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Dynamic padding as transformers' and TRL's collators do it: each batch to its longest row, on the right."""
    longest = max(len(r["input_ids"]) for r in rows)
    batch = {"input_ids": [], "attention_mask": [], "labels": []}
    for r in rows:
        extra = longest - len(r["input_ids"])
        batch["input_ids"].append(torch.nn.functional.pad(r["input_ids"], (0, extra), value=0))
        batch["attention_mask"].append(torch.nn.functional.pad(torch.ones_like(r["input_ids"]), (0, extra), value=0))
        batch["labels"].append(torch.nn.functional.pad(r["labels"], (0, extra), value=-100))
    return {k: torch.stack(v) for k, v in batch.items()}


class InOrder(torch.utils.data.IterableDataset):
    """``rows`` in their order: Trainer does not shuffle an iterable dataset, so batch k is rows 8k..8k+7."""

    def __init__(self, rows: list) -> None:
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)



def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny models' ``VOCAB`` ids, built in memory: ``w0`` .. ``w124``, then
    ``<pad>``, ``<eos>``, ``<unk>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(VOCAB - 3)}
    words.update({"<pad>": VOCAB - 3, "<eos>": VOCAB - 2, "<unk>": VOCAB - 1})
    inner = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def texts(count: int, shortest: int = 5, longest: int = 40, seed: int = 0) -> list[str]:
    """``count`` texts of :func:`tokenizer`'s words, their lengths drawn between ``shortest`` and ``longest``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest, (count,), generator=g)
    return [" ".join(f"w{int(t)}" for t in torch.randint(0, VOCAB - 3, (int(n),), generator=g)) for n in lengths]


def sft_arguments(output_dir, **overrides):
    """TRL's ``SFTConfig`` defaults (bf16, gradient checkpointing...), quiet, with ``arguments``' learning rate
    and seed, every step logged, 64-token rows (and any override)."""
    import trl

    values = dict(output_dir=str(output_dir), report_to="none", disable_tqdm=True, learning_rate=1e-2, seed=3,
                  logging_steps=1, save_strategy="no", max_length=64, per_device_train_batch_size=8)
    values.update(overrides)
    return trl.SFTConfig(**values)


def lora_config():
    """A rank-4 LoRA on every layer's ``q_proj`` and ``v_proj``."""
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
