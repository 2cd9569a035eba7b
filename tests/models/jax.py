"""Models and helpers shared by the hbp.jax tests (tests/test_jax_*.py)."""

import jax
import jax.numpy as jnp
import pytest

import hbp
import hbp.jax as hj

RTOL = 1e-5  # float32 summation order differs between one program and separate pieces


def mlp_params(key, depth, width):
    keys = jax.random.split(key, depth)
    return [jax.random.normal(k, (width, width)) / width**0.5 for k in keys]


def mlp_loss(params, x):
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.sum(x**2)


def resnet_params(key, depth, width):
    k1, k2 = jax.random.split(key)
    return {
        "w1": mlp_params(k1, depth, width),
        "w2": mlp_params(k2, depth, width),
        "scale": jnp.ones((width,)),
    }


def resnet_loss(params, x):
    """Residual blocks plus a long skip from the input to the end: a DAG, not a chain."""
    h = x
    for w1, w2 in zip(params["w1"], params["w2"]):
        h = h + jax.nn.relu(h @ w1) @ w2
    return jnp.mean((h * params["scale"] + x) ** 2)


def assert_trees_close(a, b, rtol=RTOL):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.shape == y.shape and x.dtype == y.dtype
        scale = float(jnp.max(jnp.abs(y)))
        assert jnp.allclose(x, y, rtol=rtol, atol=rtol * scale), float(jnp.max(jnp.abs(x - y)))


def _gelu_tanh(x):
    return 0.5 * x * (1 + jnp.tanh(0.7978845608 * (x + 0.044715 * x**3)))


@jax.custom_vjp
def custom_gelu(x):
    return _gelu_tanh(x)


custom_gelu.defvjp(
    lambda x: (_gelu_tanh(x), x),
    lambda x, g: (g * jax.vmap(jax.grad(_gelu_tanh))(x.ravel()).reshape(x.shape),),
)


def transformer_params(key, layers=2, d=16):
    k = jax.random.split(key, 4)
    return {
        "qkv": jax.random.normal(k[0], (layers, d, 3 * d)) / d**0.5,
        "proj": [(jax.random.normal(k[1], (d, d)) / d**0.5, jnp.zeros(d))] * layers,
        "mlp": jax.random.normal(k[2], (layers, d, 2 * d)) / d**0.5,
    }


def transformer_loss(params, x, mask, heads=2):
    """Pre-norm-free transformer written the JAX way: lax.scan over stacked layer weights,
    einsum attention with a boolean mask, a custom_vjp GELU, a jax.checkpoint'ed MLP."""
    b, t, d = x.shape
    proj_w = jnp.stack([w for w, _ in params["proj"]])

    @jax.checkpoint
    def mlp(h, w):
        return custom_gelu(h @ w) @ w.T

    def layer(h, ws):
        qkv_w, pw, mw = ws
        q, k, v = jnp.split(h @ qkv_w, 3, axis=-1)
        q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
        s = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(d / heads)
        a = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
        h = h + jnp.einsum("bhts,bshd->bthd", a, v).reshape(b, t, d) @ pw
        return h + mlp(h, mw), None

    h, _ = jax.lax.scan(layer, x, (params["qkv"], proj_w, params["mlp"]))
    return jnp.mean(h**2) + sum(jnp.sum(bias) for _, bias in params["proj"])


def tightest_budget(fun, args, **options) -> int:
    """The smallest feasible budget in bytes (the most recompute, nested plans)."""
    with pytest.raises(hbp.BudgetError) as info:
        hj.height_compressed_grad(fun, budget=1, **options).get_plan(*args)
    return info.value.minimum
