"""What the fully_shard tests share: the tiny decoder, its sharding on the 8-device mesh, a batch, eager training.

A test module imports the ``seeded`` (autouse) and ``mesh`` fixtures from here
along with the helpers it uses.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch_xla
import torch_xla.distributed.spmd as xs

import torch_xla_ext as txe
from torch_xla_ext.distributed import fully_shard, get_fully_sharded_modules
from torch_xla_ext._xla import xlac
from torch_xla_ext.testing import measure_transfers, models
from torch_xla_ext.testing.tolerances import tolerance

FSDP8 = "{devices=[8,1]0,1,2,3,4,5,6,7}"
FSDP8_1D = "{devices=[8]0,1,2,3,4,5,6,7}"
EXACT = {"atol": 0.0, "rtol": 0.0}  # values copied or moved, never computed

# The tiny decoder: vocabulary, width, layers; a batch of 8 x 6 tokens.
VOCAB, WIDTH, LAYERS, TOKENS = 32, 16, 4, 48
STEPS = 3
# Longest accumulation feeding one trained value: per step, each block's
# LayerNorm (WIDTH), up (WIDTH) and down (2 * WIDTH) reductions, the head and
# the softmax (VOCAB), the mean over tokens (TOKENS), for every step.
TRAIN_TOL = tolerance(torch.float32, STEPS * (LAYERS * 4 * WIDTH + VOCAB + TOKENS))


@pytest.fixture(autouse=True)
def seeded():
    """Every random draw of a test (module init, randn, XLA RNG) is seeded."""
    torch.manual_seed(0)
    torch_xla.manual_seed(0)


def spec(t: torch.Tensor) -> str:
    return xlac()._get_xla_sharding_spec(t)


def tiny_decoder(vocab: int = VOCAB, d: int = WIDTH, layers: int = LAYERS, use_scan: bool = True) -> models.Decoder:
    """The tiny decoder: tied embedding and LM head, ReLU MLP blocks of hidden size 2 * d, no final norm."""
    return models.Decoder(vocab, d, layers, lambda: models.MLPBlock(d, 2 * d, torch.relu), use_scan=use_scan)


def shard_decoder(model: models.Decoder, mesh, **kw) -> models.Decoder:
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def batch(device, mesh, vocab=VOCAB):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (8, 6), generator=g)
    targets = torch.randint(0, vocab, (8, 6), generator=g)
    tx, gx = tokens.to(device), targets.to(device)
    xs.mark_sharding(tx, mesh, ("fsdp", None))
    xs.mark_sharding(gx, mesh, ("fsdp", None))
    torch_xla.sync()
    return (tokens, targets), (tx, gx)


def loss_fn(model, tokens, targets):
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def train_like_eager(model: models.Decoder, reference: models.Decoder, device, mesh) -> None:
    """STEPS of SGD on the sharded model and on an unsharded eager CPU reference; they must agree.

    Each sharded step moves nothing to the host, and every parameter and
    gradient keeps fully_shard's sharding.
    """
    (tokens, targets), (tx, gx) = batch(device, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, foreach=False)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(STEPS):
        step_like_eager(model, opt, (tx, gx), reference, ref_opt, (tokens, targets))
        for name, p in model.named_parameters():
            expected = FSDP8 if p.dim() == 2 else FSDP8_1D
            assert spec(p) == expected, name
            assert spec(p.grad) == spec(p), name
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.cpu(), r.detach(), **TRAIN_TOL, msg=name)


def step_like_eager(model: nn.Module, opt, device_batch: tuple, reference: nn.Module, ref_opt,
                    cpu_batch: tuple) -> None:
    """One optimizer step of the sharded model (moving nothing to the host) and of the CPU reference; equal losses."""
    with measure_transfers() as m:
        with txe.no_host_transfers():
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, *device_batch)
            loss.backward()
            opt.step()
            torch_xla.sync()
    assert not m.device_to_host, m.report()
    ref_opt.zero_grad()
    ref_loss = loss_fn(reference, *cpu_batch)
    ref_loss.backward()
    ref_opt.step()
    torch.testing.assert_close(loss.cpu(), ref_loss.detach(), **TRAIN_TOL)


def assert_bookkeeping(model: nn.Module) -> None:
    """Every current parameter is managed by exactly one state, under the name that reaches it."""
    managed = []
    for m in get_fully_sharded_modules(model):
        for fqn, p in m.managed_named_parameters():
            assert m.get_parameter(fqn) is p, fqn
            managed.append(p)
    assert sorted(map(id, managed)) == sorted(map(id, model.parameters()))


class TiedAcrossLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8)) for _ in range(4))
        self.layers[3][0].weight = self.layers[0][0].weight


# The tiny Hugging Face Llama (test_fsdp_buffers.py, test_fsdp_compile.py): a batch of BATCH x SEQ tokens.
LLAMA_STEPS, LLAMA_LAYERS, HIDDEN, INTERMEDIATE, VOCAB_LLAMA, BATCH, SEQ = 3, 2, 64, 128, 128, 8, 16
# Longest accumulation per step: each layer's projections (HIDDEN), attention
# over the sequence (SEQ), the MLP down projection (INTERMEDIATE) and norms,
# then the LM head, softmax over the vocabulary and the mean over tokens.
LLAMA_TOL = tolerance(torch.float32, LLAMA_STEPS * (
    LLAMA_LAYERS * (4 * HIDDEN + SEQ + INTERMEDIATE) + HIDDEN + VOCAB_LLAMA + BATCH * SEQ))


def tiny_llama():
    """The tiny LlamaForCausalLM on the CPU, initialized from seed 0 (eager attention)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LLAMA_LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB_LLAMA, max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)
