"""hbp.jax: capture, both executors, planning under a budget, and measured memory."""

import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import hbp  # noqa: E402
import hbp.jax as hj  # noqa: E402
from hbp.graph.jax_capture import capture_jaxpr  # noqa: E402
from hbp.planner.plan import Plan, Segment  # noqa: E402

pytestmark = pytest.mark.jax

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


def assert_trees_close(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.shape == y.shape and x.dtype == y.dtype
        scale = float(jnp.max(jnp.abs(y)))
        assert jnp.allclose(x, y, rtol=RTOL, atol=RTOL * scale), float(jnp.max(jnp.abs(x - y)))


@pytest.fixture(scope="module")
def mlp():
    key = jax.random.PRNGKey(0)
    return mlp_params(key, 8, 32), jax.random.normal(jax.random.PRNGKey(1), (128, 32))


@pytest.fixture(scope="module")
def resnet():
    key = jax.random.PRNGKey(2)
    return resnet_params(key, 4, 32), jax.random.normal(jax.random.PRNGKey(3), (128, 32))


def tightest_budget(fun, args, **options) -> int:
    """The smallest feasible budget in bytes (the most recompute, nested plans)."""
    with pytest.raises(hbp.BudgetError) as info:
        hj.height_compressed_grad(fun, budget=1, **options).get_plan(*args)
    return info.value.minimum


def n_nodes(fun, args, argnums=0):
    return len(capture_jaxpr(fun, *args, argnums=argnums)[0])


# ----------------------------------------------------------------------------- capture


def test_capture_sizes_flops_and_backward_model(mlp):
    params, x = mlp
    graph, closed = capture_jaxpr(mlp_loss, params, x, argnums=0)
    assert len(graph) == 1 + len(closed.jaxpr.eqns)  # x is the one input node
    assert graph.nodes[0].is_input and not graph.nodes[0].requires_grad
    dots = [n for n in graph.nodes if n.op == "jax:dot_general"]
    tanhs = [n for n in graph.nodes if n.op == "jax:tanh"]
    assert len(dots) == len(tanhs) == len(params)
    assert all(n.output_bytes == 128 * 32 * 4 for n in dots + tanhs)
    assert all(n.flops == 2 * 128 * 32 * 32 for n in dots)
    # x @ W keeps x (for dW), not W (a parameter, not an activation); tanh keeps its output.
    assert dots[0].saved_inputs == ("in0",) and dots[1].saved_inputs == (tanhs[0].name,)
    assert all(n.saves_output and n.saved_inputs == () for n in tanhs)
    # Each weight's gradient is charged to its only user.
    assert all(n.param_grad_bytes == 32 * 32 * 4 for n in dots)
    assert sum(n.param_grad_bytes for n in graph.nodes) == 8 * 32 * 32 * 4
    assert graph.outputs == [graph.nodes[-1].name]


def test_capture_inlines_jit_and_keeps_custom_rules_whole():
    def f(w, x):
        h = jax.jit(lambda a: jnp.sin(a) * 2.0)(x @ w)
        return jnp.sum(jax.nn.relu(h))

    graph, _ = capture_jaxpr(f, jnp.ones((4, 4)), jnp.ones((2, 4)), argnums=0)
    ops = [n.op for n in graph.nodes]
    assert "jax:jit" not in ops and "jax:sin" in ops  # jit body inlined
    assert "jax:custom_jvp_call" in ops  # relu's custom rule kept as one node


def test_capture_on_shape_dtype_structs(mlp):
    params, x = mlp
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, x))
    graph, _ = capture_jaxpr(mlp_loss, *abstract, argnums=0)
    assert [n.output_bytes for n in graph.nodes] == [
        n.output_bytes for n in capture_jaxpr(mlp_loss, params, x, argnums=0)[0].nodes
    ]


# ----------------------------------------------------------------------------- correctness


@pytest.mark.parametrize(
    ("strategy", "budget"),
    [("pieces", 1.0), ("pieces", 0.7), ("pieces", "tightest"), ("remat", "tightest")],
)
def test_mlp_grads_match_jax(mlp, strategy, budget):
    params, x = mlp
    if budget == "tightest":
        budget = tightest_budget(mlp_loss, (params, x))
    grad_fn = hj.height_compressed_grad(mlp_loss, budget=budget, strategy=strategy)
    assert_trees_close(grad_fn(params, x), jax.grad(mlp_loss)(params, x))
    assert grad_fn.plan is not None


@pytest.mark.parametrize("strategy", ["pieces", "remat"])
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
    for strategy in ("pieces", "remat"):
        grad_fn = hj.height_compressed_grad(loss_aux, budget, strategy=strategy, **options)
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


# ----------------------------------------------------------------------------- errors


def test_infeasible_budget_raises_budget_error_with_minimum(mlp):
    params, x = mlp
    grad_fn = hj.height_compressed_grad(mlp_loss, budget=16)  # 16 bytes
    with pytest.raises(hbp.BudgetError) as info:
        grad_fn(params, x)
    assert info.value.minimum > 16
    assert "MiB" in str(info.value)
    # The reported minimum is feasible.
    assert hj.height_compressed_grad(mlp_loss, budget=info.value.minimum).get_plan(params, x)


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


# ----------------------------------------------------------------------------- memory


@pytest.fixture(scope="module")
def deep_mlp():
    params = mlp_params(jax.random.PRNGKey(0), 16, 64)
    x = jax.random.normal(jax.random.PRNGKey(1), (2048, 64))  # 512 KiB per activation
    return params, x, hj.measure(jax.grad(mlp_loss), params, x)


@pytest.mark.parametrize("strategy", ["pieces", "remat"])
def test_measured_memory_below_naive(deep_mlp, strategy):
    """Deep MLP, tight budget, eager calls: the compiled programs' peak (their memory
    analysis plus the live arrays between them) is well below plain jax.grad's program."""
    params, x, naive = deep_mlp
    grad_fn = hj.height_compressed_grad(mlp_loss, budget=0.35, strategy=strategy)
    hc = hj.measure(grad_fn, params, x)
    assert naive.strategy == "one program" and hc.strategy == strategy
    assert hc.peak_bytes < 0.6 * naive.peak_bytes
    if strategy == "pieces":
        assert hc.n_pieces > 3
        # The planner's prediction is a fair model of what the pieces really hold.
        assert hc.peak_bytes <= 1.1 * grad_fn.plan.predicted_peak_bytes


def test_grad_of_height_compressed_saves_memory(deep_mlp):
    """jax.grad of a height_compressed function runs the pieces through its custom_vjp.
    JAX holds custom_vjp residuals until the whole backward is done and the last segment
    cannot run fused, so it saves less than height_compressed_grad, but still saves."""
    params, x, naive = deep_mlp
    f = hj.height_compressed(mlp_loss, budget=0.35, argnums=0)
    hc = hj.measure(jax.grad(f), params, x)
    assert hc.strategy == "pieces"
    assert hc.peak_bytes < 0.8 * naive.peak_bytes


def test_hbp_jit_keeps_recompute_on_cpu(deep_mlp):
    """Under a user's jit, hbp.jax.jit (XLA options that keep the checkpoint barriers on CPU)
    gives a compiled program with much less temp memory than plain jax.grad's."""
    params, x, naive = deep_mlp
    grad_fn = hj.height_compressed_grad(mlp_loss, budget=0.35)
    compiled = hj.jit(grad_fn).lower(params, x).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 0.6 * naive.temp_bytes
    assert_trees_close(hj.jit(grad_fn)(params, x), jax.grad(mlp_loss)(params, x))


def test_recompute_happens(mlp):
    """The plan's recomputation is real: more dot_general equations in the (remat) grad
    jaxpr than in jax.grad's, and recomputing pieces run in the pieces executor."""
    params, x = mlp

    def count(jaxpr, name):
        total = 0
        for eqn in jaxpr.eqns:
            total += eqn.primitive.name == name
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                total += count(sub, name)
        return total

    grad_fn = hj.height_compressed_grad(mlp_loss, budget=tightest_budget(mlp_loss, (params, x)))
    naive_dots = count(jax.make_jaxpr(jax.grad(mlp_loss))(params, x).jaxpr, "dot_general")
    hc_dots = count(jax.make_jaxpr(grad_fn)(params, x).jaxpr, "dot_general")
    assert grad_fn.plan.predicted_recompute_flops > 0
    assert hc_dots > naive_dots
    with hj.record_pieces() as rec:
        grad_fn(params, x)
    assert any(r.name.startswith("recompute+backward") for r in rec.records)
