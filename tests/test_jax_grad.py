"""hbp.jax gradients equal jax.grad's (every executor, pytrees, has_aux, argnums, static and
keyword arguments, vmap) and bad inputs raise clear errors."""

import re

import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import hbp  # noqa: E402
import hbp.jax as hj  # noqa: E402
from hbp.graph.jax_capture import capture_jaxpr  # noqa: E402
from hbp.planner.plan import Plan, Segment  # noqa: E402
from tests.models.jax import (  # noqa: E402
    RTOL,
    assert_trees_close,
    mlp_loss,
    mlp_params,
    resnet_loss,
    resnet_params,
    tightest_budget,
    transformer_loss,
    transformer_params,
)

pytestmark = pytest.mark.jax


@pytest.fixture(scope="module")
def mlp():
    key = jax.random.PRNGKey(0)
    return mlp_params(key, 8, 32), jax.random.normal(jax.random.PRNGKey(1), (128, 32))


@pytest.fixture(scope="module")
def resnet():
    key = jax.random.PRNGKey(2)
    return resnet_params(key, 4, 32), jax.random.normal(jax.random.PRNGKey(3), (128, 32))


def n_nodes(fun, args, argnums=0):
    return len(capture_jaxpr(fun, *args, argnums=argnums)[0])


def grad_fns_per_strategy(fun, budget, args, **options) -> dict:
    """strategy -> height_compressed_grad(fun, budget, strategy=...): "pieces" plans for the
    budget, the others run its plan (the strategy is the executor; the plan does not depend on
    it), so each executor is checked without planning the same graph three times."""
    first = hj.height_compressed_grad(fun, budget, strategy="pieces", **options)
    plan = first.get_plan(*args)
    others = {
        s: hj.height_compressed_grad(fun, plan=plan, strategy=s, **options)
        for s in ("remat", "fenced")
    }
    return {"pieces": first, **others}


@pytest.mark.parametrize(
    ("strategy", "budget"),
    [
        ("pieces", 1.0),
        ("pieces", 0.7),
        ("pieces", "tightest"),
        ("remat", "tightest"),
        ("fenced", "tightest"),
    ],
)
def test_mlp_grads_match_jax(mlp, strategy, budget):
    params, x = mlp
    if budget == "tightest":
        budget = tightest_budget(mlp_loss, (params, x))
    grad_fn = hj.height_compressed_grad(mlp_loss, budget=budget, strategy=strategy)
    assert_trees_close(grad_fn(params, x), jax.grad(mlp_loss)(params, x))
    assert grad_fn.plan is not None


@pytest.mark.parametrize("strategy", ["pieces", "remat", "fenced"])
def test_resnet_with_skips_and_pytree_params(resnet, strategy):
    params, x = resnet
    budget = tightest_budget(resnet_loss, (params, x))
    grad_fn = hj.height_compressed_grad(resnet_loss, budget=budget, strategy=strategy)
    assert any(s.recompute for s in grad_fn.get_plan(params, x).segments)
    assert_trees_close(grad_fn(params, x), jax.grad(resnet_loss)(params, x))


@pytest.mark.parametrize("strategy", ["pieces", "remat"])
def test_nested_hand_plan(mlp, strategy):
    """A two-level interval tree, including a recomputed last segment with children."""
    params, x = mlp
    n = n_nodes(mlp_loss, (params, x))
    plan = Plan(
        [
            Segment(0, 7, True, [Segment(0, 3, True), Segment(3, 7)]),
            Segment(7, 11, True),
            Segment(11, n, True, [Segment(11, 14, True), Segment(14, n)]),
        ]
    )
    grad_fn = hj.height_compressed_grad(mlp_loss, plan=plan, strategy=strategy)
    assert_trees_close(grad_fn(params, x), jax.grad(mlp_loss)(params, x))


def test_has_aux_and_argnums_tuple(resnet):
    params, x = resnet

    def loss_aux(params, x, target):
        h = x
        for w1, w2 in zip(params["w1"], params["w2"]):
            h = jnp.tanh(h @ w1) @ w2
        loss = jnp.mean((h - target) ** 2)
        return loss, {"pred_mean": jnp.mean(h), "n": jnp.int32(3)}

    target = jnp.zeros_like(x)
    args = (params, x, target)
    want = jax.grad(loss_aux, argnums=(0, 1), has_aux=True)(*args)
    options = {"argnums": (0, 1), "has_aux": True}
    budget = tightest_budget(loss_aux, args, **options)
    for grad_fn in grad_fns_per_strategy(loss_aux, budget, args, **options).values():
        got = grad_fn(*args)
        assert_trees_close(got[0], want[0])
        assert jnp.allclose(got[1]["pred_mean"], want[1]["pred_mean"])
        assert int(got[1]["n"]) == 3


def test_under_jit(resnet):
    params, x = resnet
    grad_fn = hj.height_compressed_grad(
        resnet_loss, budget=tightest_budget(resnet_loss, (params, x))
    )
    got = jax.jit(grad_fn)(params, x)
    assert_trees_close(got, jax.grad(resnet_loss)(params, x))
    assert grad_fn.plan is not None  # planned at trace time, from avals


@pytest.mark.parametrize("strategy", ["auto", "remat"])
def test_height_compressed_outputs_vjp_and_jit(resnet, strategy):
    params, x = resnet
    f = hj.height_compressed(resnet_loss, budget=0.7, strategy=strategy)
    assert jnp.allclose(f(params, x), resnet_loss(params, x), rtol=RTOL)
    assert_trees_close(jax.grad(f)(params, x), jax.grad(resnet_loss)(params, x))
    assert_trees_close(
        jax.grad(f, argnums=(0, 1))(params, x), jax.grad(resnet_loss, argnums=(0, 1))(params, x)
    )
    assert_trees_close(jax.jit(jax.grad(f))(params, x), jax.grad(resnet_loss)(params, x))
    assert f.get_plan(params, x).segments


def test_height_compressed_argnums_must_cover_differentiated_args(mlp):
    params, x = mlp
    f = hj.height_compressed(mlp_loss, budget=0.5, argnums=1)
    with pytest.raises(hbp.ConfigError, match="argnums"):
        jax.grad(f)(params, x)


def test_infeasible_budget_raises_budget_error_with_minimum(mlp):
    params, x = mlp
    grad_fn = hj.height_compressed_grad(mlp_loss, budget=16)  # 16 bytes
    with pytest.raises(hbp.BudgetError) as info:
        grad_fn(params, x)
    assert info.value.minimum > 16
    assert "MiB" in str(info.value) and "'50%act', the default) is always within reach" in str(
        info.value
    )  # the way out, as HCModule's says it
    # The reported minimum is feasible.
    assert hj.height_compressed_grad(mlp_loss, budget=info.value.minimum).get_plan(params, x)
    with pytest.raises(hbp.BudgetError, match="a fraction is of hbp's simulated plain step") as low:
        hj.height_compressed_grad(mlp_loss, budget=0.01)(params, x)
    least = float(re.search(r"budget=(\d\.\d\d) or more plans", str(low.value)).group(1))
    assert hj.height_compressed_grad(mlp_loss, budget=least).get_plan(params, x)


@pytest.mark.parametrize("budget", [0.0, -1, 1.5, "lots", None, True])
def test_bad_budget_raises_config_error(budget):
    with pytest.raises(hbp.ConfigError, match="budget"):
        hj.height_compressed_grad(mlp_loss, budget=budget)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"strategy": "fast"}, "strategy"),
        ({"block_size": 0}, "block_size"),
        ({"argnums": "0"}, "argnums"),
    ],
)
def test_bad_options_raise_config_error(kwargs, field):
    with pytest.raises(hbp.ConfigError, match=field):
        hj.height_compressed_grad(mlp_loss, **kwargs)


def test_non_scalar_loss_raises_type_error(mlp):
    params, x = mlp
    with pytest.raises(TypeError, match="scalar"):
        hj.height_compressed_grad(lambda p, x: x @ p[0], budget=1.0)(params, x)


@pytest.fixture(scope="module")
def transformer_trajectory():
    """The transformer's inputs, jax.grad's parameters after each of 3 SGD steps, and the
    plan budget="min" resolves to (one capture and plan: the strategy does not change it)."""
    params = transformer_params(jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 16))
    mask = jnp.tril(jnp.ones((8, 8), bool))
    reference_grad = jax.jit(jax.grad(transformer_loss))  # compiled once, not op by op
    ref, trajectory = params, []
    for _ in range(3):
        ref = jax.tree.map(lambda p, g: p - 1e-3 * g, ref, reference_grad(ref, x, mask))
        trajectory.append(ref)
    plan = hj.height_compressed_grad(transformer_loss, budget="min").get_plan(params, x, mask)
    return params, x, mask, trajectory, plan


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["pieces", "remat", "fenced"])
def test_transformer_sgd_trajectory_matches_jax_grad(transformer_trajectory, strategy):
    """3 SGD steps with height_compressed_grad at the tightest plan follow jax.grad's
    parameter trajectory (scan, masks, einsum, custom_vjp, a user's jax.checkpoint)."""
    params, x, mask, trajectory, plan = transformer_trajectory
    grad_fn = hj.height_compressed_grad(transformer_loss, plan=plan, strategy=strategy)
    mine = params
    for ref in trajectory:
        mine = jax.tree.map(lambda p, g: p - 1e-3 * g, mine, grad_fn(mine, x, mask))
        assert_trees_close(mine, ref)
    assert any(s.recompute for s in grad_fn.plan.segments)
    assert all(bool(jnp.isfinite(p).all()) for p in jax.tree.leaves(trajectory[-1]))


@pytest.mark.parametrize(
    "case", ["fori_loop", "cond", "int_and_bool_inputs", "bfloat16", "nested_pytree_argnums"]
)
def test_user_functions_match_jax_grad(case):
    keys = jax.random.split(jax.random.PRNGKey(4), 6)
    ws = [jax.random.normal(k, (16, 16)) / 4 for k in keys[:4]]
    x = jax.random.normal(keys[4], (8, 16))
    argnums, tol = 0, RTOL
    if case == "fori_loop":
        args = (ws[0], x)

        def loss(w, x):
            return jnp.sum(jax.lax.fori_loop(0, 4, lambda i, h: jnp.tanh(h @ w), x) ** 2)
    elif case == "cond":
        args = (ws, x, True)

        def loss(ws, x, flag):
            h = jnp.tanh(x @ ws[0])
            h = jax.lax.cond(flag, lambda h: jnp.sin(h @ ws[1]), lambda h: 2 * h, h)
            return jnp.sum(jnp.tanh(h @ ws[2]) ** 2)
    elif case == "int_and_bool_inputs":
        args = ({"emb": ws[0], "w": ws[1]}, jnp.arange(8) % 5, jnp.arange(8) % 2 == 0)

        def loss(p, ids, keep):
            h = jnp.tanh(p["emb"][ids] @ p["w"])
            return jnp.sum(jnp.where(keep[:, None], h, 0.0))
    elif case == "bfloat16":
        args, tol = ([w.astype(jnp.bfloat16) for w in ws], x.astype(jnp.bfloat16)), 2e-2

        def loss(ws, x):
            for w in ws:
                x = jnp.tanh(x @ w)
            return jnp.sum(x.astype(jnp.float32) ** 2)
    else:  # dicts of lists of tuples, differentiated together with the input
        args, argnums = ({"layers": [(w, jnp.zeros(16)) for w in ws]}, x), (1, 0)

        def loss(p, x):
            for w, b in p["layers"]:
                x = jnp.tanh(x @ w + b)
            return jnp.mean(x**2)

    want = jax.grad(loss, argnums=argnums)(*args)
    for grad_fn in grad_fns_per_strategy(loss, "min", args, argnums=argnums).values():
        got = grad_fn(*args)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert a.dtype == b.dtype
            assert jnp.allclose(a.astype(float), b.astype(float), rtol=tol, atol=tol), case


def test_static_arguments_and_kwargs_like_jax_grad(mlp):
    """Non-array arguments (strings, callables) are static, kwargs are passed through (array
    kwargs traced, not differentiated), as with jax.grad; each static value gets its plan."""
    params, x = mlp

    def loss(params, x, reduce, act=jnp.tanh, scale=1.0):
        for w in params:
            x = act(x @ w)
        return (jnp.sum(x) if reduce == "sum" else jnp.mean(x)) * scale

    grad_fn = hj.height_compressed_grad(loss, budget="min")
    for reduce, kwargs in [("sum", {}), ("mean", {"act": jnp.sin, "scale": jnp.float32(3.0)})]:
        want = jax.grad(loss)(params, x, reduce, **kwargs)
        assert_trees_close(grad_fn(params, x, reduce, **kwargs), want)
    assert_trees_close(
        grad_fn(params, x, "mean", act=jnp.sin, scale=jnp.float32(5.0)),
        jax.grad(loss)(params, x, "mean", act=jnp.sin, scale=jnp.float32(5.0)),
    )  # a new array kwarg value reuses the plan, not a stale constant
    with pytest.raises(TypeError, match="not a valid JAX type"):
        hj.height_compressed_grad(loss, argnums=2)(params, x, "sum")


def test_vmap_per_example_grads_and_new_shapes(mlp):
    params, x = mlp

    def example_loss(params, xi):
        for w in params:
            xi = jnp.tanh(xi @ w)
        return jnp.sum(xi**2)

    grad_fn = hj.height_compressed_grad(example_loss, budget="min")
    want = jax.vmap(jax.grad(example_loss), in_axes=(None, 0))(params, x[:16])
    assert_trees_close(jax.vmap(grad_fn, in_axes=(None, 0))(params, x[:16]), want)
    # A new input shape is captured and planned again; the old plan is reused after.
    first = grad_fn.get_plan(params, x)
    assert_trees_close(grad_fn(params, x[:32]), jax.grad(example_loss)(params, x[:32]))
    assert grad_fn.get_plan(params, x) is first


def test_loss_type_errors_come_before_planning(mlp):
    """Like jax.grad: a non-scalar, integer or pytree loss is a TypeError, even when the
    budget could not be met (no BudgetError first)."""
    params, x = mlp
    bad = {
        "shape": lambda p, x: jnp.tanh(x @ p[0]),
        "dtype": lambda p, x: jnp.sum(x @ p[0]).astype(jnp.int32),
        "pytree": lambda p, x: (jnp.sum(x @ p[0]), jnp.sum(x)),
    }
    for name, fun in bad.items():
        with pytest.raises(TypeError, match="scalar-output|real-valued") as info:
            hj.height_compressed_grad(fun, budget=16)(params, x)
        assert not isinstance(info.value, hbp.BudgetError), name


def test_argnums_list_and_out_of_range(mlp):
    params, x = mlp
    got = hj.height_compressed_grad(mlp_loss, budget=1.0, argnums=[0, 1])(params, x)
    assert isinstance(got, tuple) and len(got) == 2
    assert_trees_close(got, jax.grad(mlp_loss, argnums=(0, 1))(params, x))
    with pytest.raises(hbp.ConfigError, match=r"argnums.*\[-2, 2\)"):
        hj.height_compressed_grad(mlp_loss, budget=1.0, argnums=(0, 2))(params, x)
    with pytest.raises(hbp.ConfigError, match="argnums"):
        hj.height_compressed_grad(mlp_loss, argnums=())


def test_every_budget_form_plans_and_the_default_never_raises():
    """The JAX side takes the budget forms HCModule takes ("N%act", "min", "fit", bytes) and its
    default is one every function meets: same gradients as jax.grad, a plan each time."""
    import jax
    import jax.numpy as jnp

    import hbp.jax as hj

    def loss(w, x):
        for _ in range(6):
            x = jnp.tanh(x @ w)
        return jnp.sum(x * x)

    w = jax.random.normal(jax.random.PRNGKey(0), (32, 32)) * 0.2
    x = jax.random.normal(jax.random.PRNGKey(1), (64, 32))
    expected = jax.grad(loss)(w, x)
    for budget in (None, "30%act", "min", "fit", 10**12):
        grad = (
            hj.height_compressed_grad(loss)
            if budget is None
            else (hj.height_compressed_grad(loss, budget=budget))
        )
        assert_trees_close(grad(w, x), expected)  # to the gradient's scale (summation order)
        assert grad.plan is not None


@pytest.mark.parametrize("make_key", [jax.random.PRNGKey, jax.random.key], ids=["legacy", "typed"])
def test_dropout_drawn_from_a_key_argument(make_key):
    """`jax.random` inside the loss: its programs hold typed PRNG keys (`random_wrap`, even
    of a legacy uint32 key), whose extended dtype numpy cannot size; the recompute draws the
    same mask from the same key."""
    w = jax.random.normal(jax.random.PRNGKey(0), (3, 32, 32)) / 6
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 32))

    def loss(w, x, key):
        for i in range(3):
            key, sub = jax.random.split(key)
            h = jnp.tanh(x @ w[i])
            x = jnp.where(jax.random.bernoulli(sub, 0.7, h.shape), h / 0.7, 0.0)
        return jnp.mean(x**2)

    expected = jax.grad(loss)(w, x, make_key(3))
    grad = hj.height_compressed_grad(loss, budget="min")
    assert_trees_close(grad(w, x, make_key(3)), expected)
    assert_trees_close(jax.jit(grad)(w, x, make_key(3)), expected)


def test_a_loop_over_stacked_weights_warns_and_its_gradients_are_right():
    """NOTE [ Loops over stacked weights ]: each segment's backward returns the stacked
    weights' full-size gradient, which the plan does not count; per-layer weights do not."""
    import warnings

    w = jax.random.normal(jax.random.PRNGKey(0), (6, 32, 32)) / 6
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 32))

    def stacked(w, x):
        h, _ = jax.lax.scan(lambda h, wi: (h + jnp.tanh(h @ wi), None), x, w)
        return jnp.mean(h**2)

    def listed(ws, x):
        for wi in ws:
            x = x + jnp.tanh(x @ wi)
        return jnp.mean(x**2)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = hj.height_compressed_grad(stacked, budget="min")(w, x)
    (warned,) = [c for c in caught if "stacked weights" in str(c.message)]
    said = str(warned.message)  # where it is, in the caller's terms
    assert "args[0] (shape (6, 32, 32), sliced 6 times)" in said, said
    assert warned.category is hbp.BudgetWarning and warned.filename == __file__  # the caller's
    assert_trees_close(got, jax.grad(stacked)(w, x))
    ws = list(w)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = hj.height_compressed_grad(listed, budget="min")(ws, x)
    assert not any("stacked weights" in str(c.message) for c in caught)
    assert_trees_close(got, jax.grad(listed)(ws, x))


def test_recomputed_convolutions_under_the_fenced_executor_on_cpu_warn_once():
    """NOTE [ Convolutions inside a conditional on XLA:CPU ]: recomputed convolutions run in
    the fenced executor's conditional, XLA:CPU's slow path; hbp says so and names the way out.
    strategy="remat" has no conditional, and says nothing."""
    import warnings

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    ws = [jax.random.normal(k, (8, 8 if i else 3, 3, 3)) / 8 for i, k in enumerate(keys)]
    x = jax.random.normal(jax.random.PRNGKey(5), (4, 3, 16, 16))

    def convnet(ws, x):
        for w in ws:
            x = jnp.tanh(
                jax.lax.conv_general_dilated(
                    x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")
                )
            )
        return jnp.mean(x**2)

    for strategy, warns in (("auto", True), ("remat", False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            grad = hj.height_compressed_grad(convnet, budget="min", strategy=strategy)
            got = grad(ws, x) if strategy == "auto" else hj.jit(grad)(ws, x)
        said = [str(c.message) for c in caught if "convolution(s) are recomputed" in str(c.message)]
        assert len(said) == int(warns), (strategy, said)
        assert not warns or 'strategy="remat" under hbp.jax.jit' in said[0]
        assert_trees_close(got, jax.grad(convnet)(ws, x))
