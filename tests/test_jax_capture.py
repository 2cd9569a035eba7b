"""hbp.graph.jax_capture: sizes, FLOPs, the backward memory model, what is inlined and unrolled."""

import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import hbp.jax as hj  # noqa: E402
from hbp.graph.jax_capture import capture_jaxpr  # noqa: E402
from tests.models.jax import (  # noqa: E402
    assert_trees_close,
    mlp_loss,
    mlp_params,
    transformer_loss,
    transformer_params,
)

pytestmark = pytest.mark.jax


@pytest.fixture(scope="module")
def mlp():
    key = jax.random.PRNGKey(0)
    return mlp_params(key, 8, 32), jax.random.normal(jax.random.PRNGKey(1), (128, 32))


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


def test_scan_over_layers_is_unrolled_into_cuttable_equations():
    params = transformer_params(jax.random.PRNGKey(0), layers=3)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 16))
    mask = jnp.tril(jnp.ones((8, 8), bool))
    graph, _ = capture_jaxpr(transformer_loss, params, x, mask, argnums=0)
    ops = [n.op for n in graph.nodes]
    assert "jax:scan" not in ops
    assert ops.count("jax:softmax") + ops.count("jax:exp") >= 3  # one attention per layer
    assert ops.count("jax:custom_vjp_call") == 0 or ops.count("jax:custom_vjp_call") >= 3


@pytest.mark.slow
def test_long_scan_stays_one_node_and_its_residuals_are_counted():
    """A scan too long to unroll is one node; its backward keeps every iteration's residuals
    (saved_extra_bytes), so the predicted peak matches the measured one instead of
    ignoring them."""
    w = jax.random.normal(jax.random.PRNGKey(0), (32, 32)) / 6
    x = jax.random.normal(jax.random.PRNGKey(1), (64, 32))

    def loss(w, x):
        def body(h, _):
            for _ in range(8):
                h = jnp.tanh(h @ w)
            return h, None

        return jnp.mean(jax.lax.scan(body, x, None, length=1000)[0] ** 2)

    graph, _ = capture_jaxpr(loss, w, x, argnums=0)
    (scan,) = [n for n in graph.nodes if n.op == "jax:scan"]
    assert scan.saved_extra_bytes >= 1000 * 8 * 64 * 32 * 4  # a tanh output per iteration
    grad_fn = hj.height_compressed_grad(loss, budget=1.0, strategy="pieces")
    assert_trees_close(grad_fn(w, x), jax.grad(loss)(w, x))
    measured = hj.measure(grad_fn, w, x).peak_bytes
    assert 0.8 * measured <= grad_fn.plan.predicted_peak_bytes <= 1.25 * measured
