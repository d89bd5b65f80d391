"""A pure-JAX Llama training step with the Hugging Face model's semantics: the reference ``tpu-fit`` is sized against.

The step is what ``tpu-fit`` lowers from the torch model, written the way a
JAX trainer (MaxText) writes it, so that both compile for the same slice with
the same TPU compiler and their figures can be read side by side
(``bench_sizing.py``):

- the model of ``transformers.LlamaForCausalLM``: token embedding, decoder
  layers (RMSNorm, rotary embedding from the config's own rotary
  frequencies and scaling, grouped-query causal attention, SwiGLU MLP),
  final RMSNorm, the output head (untied, or the embedding when the config
  ties them), the shifted next-token cross-entropy over fp32 logits
  averaged over every predicted token (``labels=input_ids``);
- the layers' parameters stored stacked (``[L, ...]``), one ``lax.scan``
  over them, each layer wrapped in ``jax.checkpoint`` with the path's
  policy (``nothing_saveable``: recompute the layer from its input;
  ``dots_saveable``: keep the matmul outputs; none: keep what autodiff
  needs);
- ``torch.optim.AdamW``'s update at its defaults (lr 1e-4, betas 0.9 and
  0.999, eps 1e-8, weight decay 0.01), the steady step (the moments exist,
  step 2's bias corrections); parameters and moments fp32, ``bf16`` paths
  computing in bfloat16 over them (FSDP2's mixed precision, MaxText's
  ``dtype=bfloat16``);
- fully sharded over one ``fsdp`` axis of every chip: each weight on its
  output dim, the embedding and the head on the hidden dim (the placement
  ``hf.prepare`` gives them, and MaxText's), norms on their one dim, the
  batch on its first; parameters and moments donated, as the torch step's
  are.

:func:`loss_and_grads` and :func:`adamw` are checked against the torch model
and ``torch.optim.AdamW`` on the CPU (``test/test_jax_llama.py``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

__all__ = ["Shapes", "shapes_of", "init_params", "attention", "loss_and_grads", "adamw", "train_step", "compile_for"]

#: ``torch.optim.AdamW``'s defaults, except the learning rate: tpu-fit's step uses lr 1e-4.
LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.999), 1e-8, 0.01

#: The per-layer parameters, by the name of the torch parameter each one is (its [out, in] layout kept).
LAYER_WEIGHTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
LAYER_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What the step's shapes and numerics need from a ``LlamaConfig``."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_eps: float
    tied: bool
    #: The rotary embedding's inverse frequencies ([head_dim // 2], float32) and its output scale, as the
    #: config's rotary embedding computes them (its ``rope_scaling`` included).
    inv_freq: np.ndarray
    rotary_scale: float


def shapes_of(config: Any) -> Shapes:
    """The :class:`Shapes` of a transformers ``LlamaConfig``; ValueError for another model type or options the
    reference does not write (attention or MLP biases, another activation)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    if getattr(config, "model_type", None) != "llama":
        raise ValueError(f"jax_llama: the reference is Llama's; got model_type {getattr(config, 'model_type', None)!r}")
    for name, expected in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if getattr(config, name, expected) != expected:
            raise ValueError(f"jax_llama: the reference writes {name}={expected!r}; the config has "
                             f"{getattr(config, name)!r}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotary = LlamaRotaryEmbedding(config)
    return Shapes(vocab=config.vocab_size, hidden=config.hidden_size, intermediate=config.intermediate_size,
                  layers=config.num_hidden_layers, heads=config.num_attention_heads,
                  kv_heads=config.num_key_value_heads, head_dim=head_dim, rms_eps=float(config.rms_norm_eps),
                  tied=bool(config.tie_word_embeddings), inv_freq=rotary.inv_freq.float().numpy(),
                  rotary_scale=float(rotary.attention_scaling))


def param_shapes(s: Shapes) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape; the layers' stacked on a leading ``[L]``."""
    out = {"embed_tokens.weight": (s.vocab, s.hidden), "norm.weight": (s.hidden,)}
    per_layer = {"self_attn.q_proj.weight": (s.heads * s.head_dim, s.hidden),
                 "self_attn.k_proj.weight": (s.kv_heads * s.head_dim, s.hidden),
                 "self_attn.v_proj.weight": (s.kv_heads * s.head_dim, s.hidden),
                 "self_attn.o_proj.weight": (s.hidden, s.heads * s.head_dim),
                 "mlp.gate_proj.weight": (s.intermediate, s.hidden),
                 "mlp.up_proj.weight": (s.intermediate, s.hidden),
                 "mlp.down_proj.weight": (s.hidden, s.intermediate),
                 "input_layernorm.weight": (s.hidden,), "post_attention_layernorm.weight": (s.hidden,)}
    out.update({f"layers.{k}": (s.layers, *v) for k, v in per_layer.items()})
    if not s.tied:
        out["lm_head.weight"] = (s.vocab, s.hidden)
    return out


def init_params(s: Shapes, seed: int = 0) -> dict[str, np.ndarray]:
    """Random fp32 parameters (numpy, host): for the CPU check; sizing uses shapes only."""
    rng = np.random.default_rng(seed)
    return {k: (np.ones(v, np.float32) + 0.1 * rng.standard_normal(v).astype(np.float32) if k.endswith("norm.weight")
                else 0.05 * rng.standard_normal(v).astype(np.float32)) for k, v in param_shapes(s).items()}


def _rms_norm(x, w, eps):
    """HF's RMSNorm: normalized in fp32, cast back to the input's dtype, then scaled."""
    import jax
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + eps)
    return w * normed.astype(x.dtype)


def attention(q, k, v):
    """Causal grouped-query attention without repeating K and V: each KV head serves its group of query heads.

    ``q`` is ``[batch, seq, kv_heads, group, head_dim]``, ``k`` and ``v`` are
    ``[batch, seq, kv_heads, head_dim]``; the result has ``q``'s shape. The
    scores are scaled by ``head_dim ** -0.5`` and go through the softmax in
    float32; the probabilities are cast to ``v``'s dtype before they weight it
    (HF's eager attention, and its ``sdpa`` path's math).
    """
    import jax
    import jax.numpy as jnp

    seq, head_dim = q.shape[1], q.shape[-1]
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k) * (head_dim ** -0.5)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    probs = jax.nn.softmax(jnp.where(causal, scores.astype(jnp.float32), -jnp.inf), axis=-1).astype(v.dtype)
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, v)


def _layer(s: Shapes, constrain):
    """One decoder layer ``(x, p, cos, sin) -> x`` over one layer's parameters ``p``."""
    import jax
    import jax.numpy as jnp

    group = s.heads // s.kv_heads
    half = s.head_dim // 2

    def rope(t, cos, sin):  # t: [b, s, n, d]; HF's x * cos + rotate_half(x) * sin
        rotated = jnp.concatenate([-t[..., half:], t[..., :half]], axis=-1)
        return t * cos[None, :, None, :] + rotated * sin[None, :, None, :]

    def layer(x, p, cos, sin):
        b, t, _ = x.shape
        h = _rms_norm(x, p["input_layernorm.weight"], s.rms_eps)
        q = (h @ p["self_attn.q_proj.weight"].T).reshape(b, t, s.kv_heads, group, s.head_dim)
        k = (h @ p["self_attn.k_proj.weight"].T).reshape(b, t, s.kv_heads, s.head_dim)
        v = (h @ p["self_attn.v_proj.weight"].T).reshape(b, t, s.kv_heads, s.head_dim)
        q = rope(q.reshape(b, t, s.heads, s.head_dim), cos, sin).reshape(b, t, s.kv_heads, group, s.head_dim)
        k = rope(k, cos, sin)
        o = attention(q, k, v).reshape(b, t, s.heads * s.head_dim)
        x = constrain(x + o @ p["self_attn.o_proj.weight"].T)
        h = _rms_norm(x, p["post_attention_layernorm.weight"], s.rms_eps)
        gated = jax.nn.silu(h @ p["mlp.gate_proj.weight"].T) * (h @ p["mlp.up_proj.weight"].T)
        return constrain(x + gated @ p["mlp.down_proj.weight"].T)

    return layer


def _loss(s: Shapes, remat: str | None, bf16: bool, constrain=lambda x: x):
    """``loss(params, tokens)``: the mean next-token cross-entropy of ``tokens`` ([b, t] int32)."""
    import jax
    import jax.numpy as jnp

    layer = _layer(s, constrain)
    if remat is not None:
        policy = {"nothing_saveable": jax.checkpoint_policies.nothing_saveable,
                  "dots_saveable": jax.checkpoint_policies.dots_saveable}[remat]
        layer = jax.checkpoint(layer, policy=policy)

    def loss(params, tokens):
        compute = jnp.bfloat16 if bf16 else jnp.float32
        p = {k: v.astype(compute) for k, v in params.items()}
        b, t = tokens.shape
        positions = jnp.arange(t, dtype=jnp.float32)
        freqs = positions[:, None] * jnp.asarray(s.inv_freq)[None, :]
        angles = jnp.concatenate([freqs, freqs], axis=-1)
        cos = (jnp.cos(angles) * s.rotary_scale).astype(compute)
        sin = (jnp.sin(angles) * s.rotary_scale).astype(compute)
        x = constrain(jnp.take(p["embed_tokens.weight"], tokens, axis=0))
        stacked = {k[len("layers."):]: v for k, v in p.items() if k.startswith("layers.")}
        x, _ = jax.lax.scan(lambda h, lp: (layer(h, lp, cos, sin), None), x, stacked)
        x = _rms_norm(x, p["norm.weight"], s.rms_eps)
        head = p["embed_tokens.weight" if s.tied else "lm_head.weight"]
        logits = (x[:, :-1] @ head.T).astype(jnp.float32)  # the last position predicts nothing
        logz = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
        return jnp.mean(logz - picked)

    return loss


def loss_and_grads(s: Shapes, params, tokens, *, remat: str | None = None, bf16: bool = False):
    """``(loss, grads)`` of the model on ``tokens`` (eager JAX on the default device; the CPU check's entry)."""
    import jax

    return jax.value_and_grad(_loss(s, remat, bf16))(params, tokens)


def adamw(params, grads, m, v, step: int, lr: float = LR, weight_decay: float = WEIGHT_DECAY):
    """``torch.optim.AdamW``'s update at step ``step`` (1-based; ``m``, ``v`` the moments before it): new
    (params, m, v). Decoupled weight decay first, then the bias-corrected Adam step, as torch writes it."""
    import jax
    import jax.numpy as jnp

    b1, b2 = BETAS
    c1, c2 = 1 - b1 ** step, 1 - b2 ** step

    def one(p, g, mi, vi):
        p = p * (1 - lr * weight_decay)
        mi = b1 * mi + (1 - b1) * g
        vi = b2 * vi + (1 - b2) * g * g
        p = p - (lr / c1) * mi / (jnp.sqrt(vi) / math.sqrt(c2) + EPS)
        return p, mi, vi

    out = jax.tree.map(one, params, grads, m, v)
    pick = lambda n: jax.tree.map(lambda _, t: t[n], params, out)  # noqa: E731
    return pick(0), pick(1), pick(2)


def placement(name: str, shape: tuple[int, ...], chips: int) -> tuple[str | None, ...]:
    """The partition spec of a parameter over the ``fsdp`` axis: the embedding and the head on the hidden dim,
    a layer's weight on its output dim, a norm on its one dim; a dim ``chips`` does not divide stays whole
    (the next candidate is tried, else the parameter is replicated)."""
    stacked = name.startswith("layers.")
    dims = list(range(1 if stacked else 0, len(shape)))
    if name in ("embed_tokens.weight", "lm_head.weight"):
        dims = [1, 0]
    for d in dims:
        if shape[d] % chips == 0:
            return tuple("fsdp" if i == d else None for i in range(len(shape)))
    return (None,) * len(shape)


def train_step(s: Shapes, remat: str | None, bf16: bool, mesh):
    """The jitted steady step ``(params, m, v, tokens) -> (loss, params, m, v)`` over ``mesh`` (one ``fsdp``
    axis), parameters and moments donated; and the abstract arguments to lower it with."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    chips = mesh.devices.size
    batch_spec = NamedSharding(mesh, P("fsdp", None, None))
    loss_fn = _loss(s, remat, bf16, constrain=lambda x: jax.lax.with_sharding_constraint(x, batch_spec))
    specs = {k: NamedSharding(mesh, P(*placement(k, v, chips))) for k, v in param_shapes(s).items()}

    def step(params, m, v, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        params, m, v = adamw(params, grads, m, v, step=2)
        return loss, params, m, v

    tokens_sharding = NamedSharding(mesh, P("fsdp", None))
    jitted = jax.jit(step, in_shardings=(specs, specs, specs, tokens_sharding),
                     out_shardings=(NamedSharding(mesh, P()), specs, specs, specs), donate_argnums=(0, 1, 2))

    def abstract(batch: int, seq: int):
        tree = {k: jax.ShapeDtypeStruct(v, jnp.float32, sharding=specs[k]) for k, v in param_shapes(s).items()}
        return tree, tree, tree, jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=tokens_sharding)

    return jitted, abstract


def compile_for(config: Any, topology: str, *, batch: int, seq: int, path: str):
    """The reference step of ``config`` for ``path`` (a ``tpu-fit`` scan path name) compiled for ``topology``:
    a ``tpu.CompiledForTpu`` read as ``tpu-fit`` reads its own step's. ValueError for a loop path (the
    reference is scanned) or a batch the slice's chips do not divide."""
    from jax.sharding import Mesh

    from torch_xla_ext.tpu import _client
    from torch_xla_ext.tpu.fit import parse_path
    from tpu_bench import compile_jax

    options = parse_path(path)  # the reference's layers are stored stacked whether or not the path says so
    if not options.scan:
        raise ValueError(f"jax_llama: the reference step is scanned; {path!r} is not a scan path")
    devices = _client.topology_devices(topology)
    if batch % len(devices):
        raise ValueError(f"jax_llama: batch {batch} does not split over {topology}'s {len(devices)} chips")
    mesh = Mesh(np.array(devices), ("fsdp",))
    jitted, abstract = train_step(shapes_of(config), options.remat, options.bf16, mesh)
    return compile_jax(jitted, abstract(batch, seq), topology)
