"""hbp.jax under the caller's own `jax.jit`: same gradients, less compiled temp memory.

The default strategy ("auto" -> "fenced" when traced) must keep the plan's recomputation in
the one program XLA compiles from the user's jit (NOTE [ Recomputation under the caller's
jax.jit ] in hbp.integrations.jax.remat). Memory claims here use the compiled program's
memory analysis (deterministic); RSS belongs to experiments/bench_jax.py.
"""

import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import hbp  # noqa: E402
import hbp.jax as hj  # noqa: E402
from hbp.graph.jax_capture import capture_jaxpr  # noqa: E402
from hbp.planner.plan import Plan, Segment  # noqa: E402
from tests.models.jax import RTOL, assert_trees_close  # noqa: E402

pytestmark = pytest.mark.jax


def residual_loss(params, x):
    """The JAX benchmark's workload (experiments/bench_jax.py), small: an MLP chain with residual skips."""
    h = x
    for w in params:
        h = h + jnp.tanh(h @ w)
    return jnp.mean(h**2)


def pytree_loss(params, x, target):
    """Dict/list/tuple parameters, a long skip, and an aux output."""
    h = x
    for w, b in params["blocks"]:
        h = h + jax.nn.relu(h @ w + b)
    pred = h * params["scale"] + x
    loss = jnp.mean((pred - target) ** 2)
    return loss, {"pred_mean": jnp.mean(pred), "n": jnp.int32(len(params["blocks"]))}


@pytest.fixture(scope="module")
def residual():
    keys = jax.random.split(jax.random.PRNGKey(0), 13)
    params = [jax.random.normal(k, (128, 128)) / 128**0.5 for k in keys[:-1]]
    return params, jax.random.normal(keys[-1], (1024, 128))  # 512 KiB per activation


@pytest.fixture(scope="module")
def pytree():
    keys = jax.random.split(jax.random.PRNGKey(1), 10)
    blocks = [(jax.random.normal(k, (32, 32)) / 6, jnp.zeros(32)) for k in keys[:6]]
    params = {"blocks": blocks, "scale": jnp.ones(32)}
    x = jax.random.normal(keys[6], (64, 32))
    return params, x, jnp.zeros_like(x)


def temp_bytes(fn, *args) -> int:
    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


# ----------------------------------------------------------------------------- memory


def test_user_jit_halves_compiled_temp_memory(residual):
    """jax.jit(height_compressed_grad(f, 0.3)) compiles to at most half the temp memory of
    jax.jit(jax.grad(f)), with the same gradients."""
    params, x = residual
    grad_fn = hj.height_compressed_grad(residual_loss, budget=0.3)
    naive = temp_bytes(jax.grad(residual_loss), params, x)
    mine = temp_bytes(grad_fn, params, x)
    assert mine <= 0.5 * naive, (mine, naive)
    assert any(s.recompute for s in grad_fn.plan.segments)
    assert_trees_close(jax.jit(grad_fn)(params, x), jax.jit(jax.grad(residual_loss))(params, x))


def test_fenced_follows_the_budget_under_jit(residual):
    """A tighter budget compiles to less temp memory (the plan decides, not XLA)."""
    params, x = residual
    temps = [
        temp_bytes(hj.height_compressed_grad(residual_loss, budget=b), params, x)
        for b in (1.0, 0.5, "min")
    ]
    assert temps[0] > temps[1] > temps[2], temps


def test_called_as_is_runs_one_fenced_program_below_half(residual):
    params, x = residual
    naive = hj.measure(jax.grad(residual_loss), params, x)
    report = hj.measure(hj.height_compressed_grad(residual_loss, budget=0.3), params, x)
    assert report.strategy == "fenced" and report.n_pieces == 1
    assert report.peak_bytes <= 0.5 * naive.peak_bytes, (report.peak_bytes, naive.peak_bytes)


def test_height_compressed_under_jit_saves_temp_memory(residual):
    params, x = residual
    f = hj.height_compressed(residual_loss, budget=0.3)
    naive = temp_bytes(jax.grad(residual_loss), params, x)
    assert temp_bytes(jax.grad(f), params, x) <= 0.5 * naive
    assert_trees_close(jax.jit(jax.grad(f))(params, x), jax.grad(residual_loss)(params, x))


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_pytrees_has_aux_and_argnums_tuple(pytree, jit):
    """The default strategy ("auto": "fenced" eagerly and traced, so one case covers both
    names; test_nested_plan_fenced names "fenced" itself)."""
    params, x, target = pytree
    options = {"argnums": (0, 1), "has_aux": True}
    grad_fn = hj.height_compressed_grad(pytree_loss, "min", **options)
    run = jax.jit(grad_fn) if jit else grad_fn
    got = run(params, x, target)
    want = jax.grad(pytree_loss, **options)(params, x, target)
    assert any(s.recompute for s in grad_fn.plan.segments)
    assert_trees_close(got[0], want[0])
    assert jnp.allclose(got[1]["pred_mean"], want[1]["pred_mean"], rtol=RTOL)
    assert int(got[1]["n"]) == 6


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_nested_plan_fenced(residual, jit):
    """A two-level interval tree, including a recomputed last segment with children."""
    params, x = residual
    params = params[:4]
    n = len(capture_jaxpr(residual_loss, params, x, argnums=0)[0])
    plan = Plan(
        [
            Segment(0, 6, True, [Segment(0, 3, True), Segment(3, 6)]),
            Segment(6, 9, True),
            Segment(9, n, True, [Segment(9, 11, True), Segment(11, n)]),
        ]
    )
    grad_fn = hj.height_compressed_grad(residual_loss, plan=plan, strategy="fenced")
    run = jax.jit(grad_fn) if jit else grad_fn
    assert_trees_close(run(params, x), jax.grad(residual_loss)(params, x))


def test_vmap_and_grad_of_grad_under_jit(pytree):
    """The fenced segments compose with vmap (per-example gradients) and with reverse mode
    over their backward (a gradient of a function of the gradient)."""
    params, x, target = pytree

    def example_loss(params, xi, ti):
        return pytree_loss(params, xi, ti)[0]

    grad_fn = hj.height_compressed_grad(example_loss, budget="min")
    per_example = jax.jit(jax.vmap(grad_fn, in_axes=(None, 0, 0)))(params, x[:8], target[:8])
    want = jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0))(params, x[:8], target[:8])
    assert_trees_close(per_example, want)

    def grad_norm(fn):
        return lambda p: sum(jnp.sum(g**2) for g in jax.tree.leaves(fn(p, x, target)))

    got = jax.jit(jax.grad(grad_norm(grad_fn)))(params)
    assert_trees_close(got, jax.grad(grad_norm(jax.grad(example_loss)))(params), rtol=1e-4)


def test_forward_mode_needs_remat_strategy(pytree):
    params, x, target = pytree

    def f(params):
        return pytree_loss(params, x, target)[0]

    tangent = jax.tree.map(jnp.ones_like, params)
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(hj.height_compressed(f, budget="min"), (params,), (tangent,))
    got = jax.jvp(hj.height_compressed(f, budget="min", strategy="remat"), (params,), (tangent,))
    want = jax.jvp(f, (params,), (tangent,))
    assert jnp.allclose(got[1], want[1], rtol=1e-4)


# ----------------------------------------------------------------------------- arguments


def test_repeated_argnums_raise_like_jax_grad(residual):
    params, x = residual
    with pytest.raises(TypeError, match="argnums"):
        hj.height_compressed_grad(residual_loss, argnums=(0, 0))
    with pytest.raises(hbp.ConfigError, match="distinct"):
        hj.height_compressed_grad(residual_loss, budget=1.0, argnums=(0, -2))(params, x)


def test_height_compressed_takes_kwargs_and_static_arguments(pytree):
    params, x, target = pytree

    def loss(params, x, reduce, target=None, scale=1.0):
        h = x
        for w, b in params["blocks"]:
            h = h + jnp.tanh(h @ w + b)
        err = (h - target) ** 2
        return (jnp.sum(err) if reduce == "sum" else jnp.mean(err)) * scale

    f = hj.height_compressed(loss, budget="min")
    for reduce, scale in [("sum", 1.0), ("mean", jnp.float32(3.0))]:
        kwargs = {"target": target, "scale": scale}
        assert jnp.allclose(f(params, x, reduce, **kwargs), loss(params, x, reduce, **kwargs))
        want = jax.grad(loss)(params, x, reduce, **kwargs)
        assert_trees_close(jax.grad(f)(params, x, reduce, **kwargs), want)
        assert_trees_close(
            jax.jit(jax.grad(f), static_argnums=2)(params, x, reduce, **kwargs), want
        )
    assert f.get_plan(params, x, "sum", target=target).segments
