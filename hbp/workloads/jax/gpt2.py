"""GPT-2 in plain JAX: the model of hbp/workloads/gpt2.py (same `GPT2Config`, same profiles).

Token + learned position embeddings, `n_layer` pre-LayerNorm blocks (causal self-attention,
GELU-tanh MLP), a final LayerNorm and an LM head tied to the token embedding; the loss is the
mean cross-entropy of the next token. Parameters are nested dicts named as the torch model's
parameters (`params["blocks"][i]["attn"]["c_attn"]["weight"]`), Linear weights stored
[in, out]; initialised as the torch model is (normal(0, 0.02), residual projections scaled by
1/sqrt(2 n_layer), zero biases, unit LayerNorm gains), from a NumPy generator.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from hbp.workloads.gpt2 import GPT2Config, derived_facts  # noqa: F401  (the same facts)
from hbp.workloads.jax.base import JaxWorkload, param_facts

LN_EPS = 1e-5  # torch.nn.LayerNorm's default
EMBEDDINGS = ("wte.weight", "wpe.weight")  # params_from_torch keeps their [rows, d] layout


def layer_norm(p: dict, x):
    """LayerNorm over the last axis; `p` has "weight" and, with bias, "bias"."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + LN_EPS) * p["weight"]
    return y + p["bias"] if "bias" in p else y


def linear(p: dict, x):
    y = x @ p["weight"]
    return y + p["bias"] if "bias" in p else y


def attention(cfg: GPT2Config, p: dict, x):
    """Causal multi-head self-attention: [B, T, D] -> [B, T, D]."""
    B, T, D = x.shape
    hs = D // cfg.n_head
    q, k, v = jnp.split(linear(p["c_attn"], x), 3, axis=-1)
    # [B, T, D] -> [B, nh, T, hs]
    q, k, v = (t.reshape(B, T, cfg.n_head, hs).transpose(0, 2, 1, 3) for t in (q, k, v))
    scores = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(hs)  # [B, nh, T, T]
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    scores = jnp.where(causal, scores, -jnp.inf)
    y = jax.nn.softmax(scores, axis=-1) @ v  # [B, nh, T, hs]
    return linear(p["c_proj"], y.transpose(0, 2, 1, 3).reshape(B, T, D))


def mlp(p: dict, x):
    return linear(p["c_proj"], jax.nn.gelu(linear(p["c_fc"], x), approximate=True))


def block(cfg: GPT2Config, p: dict, x):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""
    x = x + attention(cfg, p["attn"], layer_norm(p["ln_1"], x))
    return x + mlp(p["mlp"], layer_norm(p["ln_2"], x))


def embed(params: dict, idx, targets):
    """idx [B, T] token ids -> [B, T, D]."""
    T = idx.shape[1]
    return params["wte"]["weight"][idx] + params["wpe"]["weight"][:T]


def head(params: dict, x, idx, targets):
    """Final LayerNorm, tied LM head, mean cross-entropy against targets [B, T]."""
    h = layer_norm(params["ln_f"], x)
    logits = h @ params["wte"]["weight"].T  # [B, T, V]
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - picked)


def init_params(cfg: GPT2Config, rng: np.random.Generator) -> dict:
    """Random weights as the torch GPT2's `_init_weights` draws them (not the same numbers),
    from a NumPy generator (JAX's threefry would cost an XLA compilation per shape)."""
    D, std = cfg.d_model, 0.02
    proj_std = std / math.sqrt(2 * cfg.n_layer)

    def normal(shape, scale=std):
        return scale * rng.standard_normal(shape, dtype=np.float32)

    def lin(n_in, n_out, scale=std):
        p = {"weight": normal((n_in, n_out), scale)}
        if cfg.bias:
            p["bias"] = np.zeros((n_out,), np.float32)
        return p

    def norm():
        p = {"weight": np.ones((D,), np.float32)}
        if cfg.bias:
            p["bias"] = np.zeros((D,), np.float32)
        return p

    params = {
        "wte": {"weight": normal((cfg.vocab_size, D))},
        "wpe": {"weight": normal((cfg.seq_len, D))},
    }
    params["blocks"] = [
        {
            "ln_1": norm(),
            "attn": {"c_attn": lin(D, 3 * D), "c_proj": lin(D, D, proj_std)},
            "ln_2": norm(),
            "mlp": {"c_fc": lin(D, 4 * D), "c_proj": lin(4 * D, D, proj_std)},
        }
        for _ in range(cfg.n_layer)
    ]
    params["ln_f"] = norm()
    return params


def make_batch(cfg: GPT2Config, rng: np.random.Generator) -> tuple:
    """(idx, targets): random token ids [B, T] (int32) and the same sequence shifted by one."""
    tokens = rng.integers(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), dtype=np.int32)
    return jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])


def make_workload(cfg: GPT2Config, profile: str, params_rng, batch_rng) -> JaxWorkload:
    params = init_params(cfg, params_rng)
    facts = dataclasses.asdict(cfg)
    facts.update(param_facts(params))
    facts["n_blocks"] = cfg.n_layer
    facts.update(derived_facts(cfg))
    return JaxWorkload(
        name="gpt2",
        profile=profile,
        params=params,
        batch=make_batch(cfg, batch_rng),
        embed=embed,
        blocks=[partial(block, cfg)] * cfg.n_layer,
        head=head,
        config=facts,
    )
