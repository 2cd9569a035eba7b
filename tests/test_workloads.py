"""The workloads: build, step, determinism, overrides, Hydra configs for all; fx tracing, the
block-chain contract and the synthetic DAG's structure for hbp's own four (the libraries'
models: tests/test_workloads_real.py). Medium/large profiles are only
described (built on the meta device) except one slow GPT-2 medium forward."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import math
from pathlib import Path

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.utils.checkpoint import checkpoint

from hbp.errors import ConfigError
from hbp.runtime.tracker import measure_callable_peak
from hbp.workloads import OWN_WORKLOADS, PROFILES, WORKLOADS, build, describe, resolve_config

CONF = Path(__file__).resolve().parents[1] / "conf" / "workload"


def step(workload, model=None, seed=0):
    """Loss and {name: grad} of one forward + backward of `model` (default: the workload's)."""
    model = workload.model if model is None else model
    model.zero_grad(set_to_none=True)
    loss = workload.step_loss(model, workload.make_batch(seed))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", WORKLOADS)
def test_small_step_gives_finite_loss_and_grads_for_every_parameter(name):
    wl = build(name, "small")
    assert wl.name == name and wl.profile == "small" and wl.model.training
    params = list(wl.model.parameters())
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in params)
    assert wl.config["params"] == sum(p.numel() for p in params)
    assert wl.config["n_blocks"] == len(wl.blocks) >= 2

    loss, grads = step(wl)
    assert loss.ndim == 0 and torch.isfinite(loss)
    for pname, grad in grads.items():
        assert torch.isfinite(grad).all(), pname
        assert grad.abs().sum() > 0, f"{pname} got an all-zero gradient"


@pytest.mark.parametrize("name", WORKLOADS)
def test_same_seed_same_weights_batch_and_loss_different_seed_differs(name):
    rng_before = torch.get_rng_state()
    a, b, c = build(name, seed=3), build(name, seed=3), build(name, seed=4)
    assert torch.equal(torch.get_rng_state(), rng_before), "build must not move the global RNG"

    for (key, pa), pb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(pa, pb), key
    assert any(
        not torch.equal(pa, pc) for pa, pc in zip(a.model.parameters(), c.model.parameters())
    )
    batch_a, batch_b, other = a.make_batch(0), b.make_batch(0), a.make_batch(1)
    for xa, xb, xo in zip(batch_a.args, batch_b.args, other.args):
        assert torch.equal(xa, xb)
        assert not torch.equal(xa, xo)
    assert torch.equal(batch_a.targets, batch_b.targets)
    assert torch.equal(step(a)[0], step(b)[0])
    assert not torch.equal(step(a)[0], step(c)[0])


@pytest.mark.parametrize("name", OWN_WORKLOADS)
def test_symbolic_trace_gives_same_loss_and_grads(name):
    wl = build(name)
    traced = torch.fx.symbolic_trace(wl.model)
    assert isinstance(traced, torch.fx.GraphModule)
    loss, grads = step(wl)
    traced_loss, traced_grads = step(wl, traced)
    assert torch.equal(loss, traced_loss)
    assert len(traced_grads) == len(grads)
    assert traced_grads.keys() == grads.keys()
    for pname, grad in grads.items():
        assert torch.equal(traced_grads[pname], grad), pname
    # The trace is an op-level graph of the whole forward, not one opaque call.
    assert sum(n.op == "call_module" for n in traced.graph.nodes) > len(wl.blocks)


@pytest.mark.parametrize("name", OWN_WORKLOADS)
def test_forward_applies_blocks_in_order_as_a_chain(name):
    wl = build(name)
    calls = []

    def record(index):
        def hook(module, args, output):
            calls.append((index, args[0], output))

        return hook

    handles = [b.register_forward_hook(record(i)) for i, b in enumerate(wl.blocks)]
    step(wl)
    for h in handles:
        h.remove()
    assert [i for i, _, _ in calls] == list(range(len(wl.blocks)))
    for (_, _, out), (_, state_in, _) in zip(calls, calls[1:]):
        assert state_in is out, "each block must get the previous block's output"


class Segment(nn.Module):
    """Consecutive blocks run as one checkpointed segment (what the checkpoint mode does)."""

    def __init__(self, blocks):
        super().__init__()
        self.inner = nn.ModuleList(blocks)

    def run(self, state):
        for block in self.inner:
            state = block(state)
        return state

    def forward(self, state):
        return checkpoint(self.run, state, use_reentrant=False)


@pytest.mark.parametrize("name", OWN_WORKLOADS)
def test_grouping_blocks_into_checkpointed_segments_keeps_loss_and_grads(name):
    wl = build(name)
    loss, grads = step(wl)
    blocks = list(wl.blocks)
    wl.model.blocks = nn.ModuleList(Segment(blocks[i : i + 2]) for i in range(0, len(blocks), 2))
    segment_loss, _ = step(wl)
    torch.testing.assert_close(segment_loss, loss, rtol=1e-6, atol=1e-6)
    # Same parameter objects (now under blocks.<segment>.inner.<i>), in the same order.
    segment_grads = [p.grad for p in wl.model.parameters()]
    assert len(segment_grads) == len(grads)
    for g, ref in zip(segment_grads, grads.values()):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", WORKLOADS)
def test_deepcopy_gives_an_independent_equal_model(name):
    wl = build(name)
    clone = copy.deepcopy(wl.model)
    assert torch.equal(step(wl, clone)[0], step(wl)[0])
    with torch.no_grad():
        next(clone.parameters()).add_(1.0)
    assert not torch.equal(next(clone.parameters()), next(wl.model.parameters()))


def test_unknown_workload_profile_and_override_name_the_field():
    with pytest.raises(ConfigError) as err:
        build("gpt3")
    assert err.value.field == "workload" and "synthetic_dag" in str(err.value)
    with pytest.raises(ConfigError) as err:
        build("gpt2", "huge")
    assert err.value.field == "profile" and "medium" in str(err.value)
    with pytest.raises(ConfigError) as err:
        build("gpt2", n_layers=6)
    assert err.value.field == "workload.n_layers" and "n_layer" in str(err.value)
    with pytest.raises(ConfigError) as err:
        describe("resnet", depth=20)
    assert err.value.field == "workload.depth" and "50" in str(err.value)
    with pytest.raises(ConfigError) as err:
        build("gpt2", n_head=5)
    assert err.value.field == "workload.n_head" and "d_model=128" in str(err.value)
    with pytest.raises(ConfigError) as err:
        build("gpt2", n_layer="six")
    assert err.value.field == "workload.n_layer"
    with pytest.raises(ConfigError) as err:
        build("unet", image_size=17)
    assert err.value.field == "workload.image_size"
    with pytest.raises(ConfigError) as err:
        build("synthetic_dag", skip_prob=1.5)
    assert err.value.field == "workload.skip_prob"


def profile_value(name, field):
    return getattr(importlib.import_module(f"hbp.workloads.{name}").PROFILES["small"], field)


def test_overrides_replace_profile_values_and_none_keeps_them():
    wl = build("gpt2", n_layer=2, seq_len=32, dropout=None)
    assert len(wl.blocks) == 2 and wl.config["n_layer"] == 2
    assert wl.config["dropout"] == profile_value("gpt2", "dropout")
    idx, targets = wl.make_batch(0).args
    assert idx.shape == targets.shape == (wl.config["batch_size"], 32)
    assert wl.config["tokens_per_batch"] == wl.config["batch_size"] * 32

    unet = resolve_config("unet", channel_mult=[1, 2, 2], image_size=16)
    assert unet.channel_mult == (1, 2, 2)
    assert build("resnet", num_classes=7).model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


@pytest.mark.parametrize("name", WORKLOADS)
def test_hydra_config_lists_every_field_as_null_and_overrides_build(name):
    conf = OmegaConf.load(CONF / f"{name}.yaml")
    fields = [f.name for f in dataclasses.fields(resolve_config(name))]
    assert list(conf.keys()) == ["name", *fields]
    assert conf.name == name and all(conf[f] is None for f in fields)

    OmegaConf.set_struct(conf, True)
    first = fields[0]
    value = {"gpt2": 2, "resnet": 34, "unet": 16, "synthetic_dag": 3, "hf": "llama"}.get(name)
    value = [16, 32] if name == "diffusers_unet" else value
    conf = OmegaConf.merge(conf, OmegaConf.from_dotlist([f"{first}={value}"]))
    with pytest.raises(Exception, match="not_a_field"):
        OmegaConf.merge(conf, OmegaConf.from_dotlist(["not_a_field=1"]))
    overrides = {k: v for k, v in conf.items() if k != "name" and v is not None}
    assert build(conf.name, "small", seed=0, **overrides).config[first] == value


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("name", WORKLOADS)
def test_every_profile_describes_without_allocating(name, profile):
    facts = describe(name, profile)
    assert facts["params"] > 0 and facts["param_bytes"] == 4 * facts["params"]
    assert facts["n_blocks"] >= 2 and facts["samples_per_batch"] >= 1


def test_reference_parameter_counts():
    assert describe("gpt2", "medium")["params"] == 124_439_808  # GPT-2 124M
    assert describe("gpt2", "large")["params"] == 354_823_168  # GPT-2 medium 355M
    assert describe("resnet", "medium")["params"] == 11_689_512  # torchvision resnet18
    assert describe("resnet", "large")["params"] == 25_557_032  # torchvision resnet50
    assert describe("resnet", "medium", depth=34)["params"] == 21_797_672  # resnet34
    assert describe("unet", "medium")["params"] == 35_746_307  # DDPM CIFAR-10: 35.7M
    gpt = describe("gpt2", "medium")
    assert gpt["tokens_per_batch"] == 8192 and gpt["n_blocks"] == 12


def test_gpt2_ties_head_to_embedding_and_scales_residual_init():
    model = build("gpt2", "small").model
    assert model.lm_head.weight is model.wte.weight
    n_layer = model.config.n_layer
    proj = torch.cat([b.mlp.c_proj.weight.flatten() for b in model.blocks])
    assert math.isclose(proj.std().item(), 0.02 / math.sqrt(2 * n_layer), rel_tol=0.05)
    assert math.isclose(model.blocks[0].mlp.c_fc.weight.std().item(), 0.02, rel_tol=0.05)


def test_gpt2_logits_path_matches_the_loss_path():
    wl = build("gpt2")
    idx, targets = wl.make_batch(0).args
    logits = wl.model(idx)
    assert logits.shape == (*idx.shape, wl.config["vocab_size"])
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(wl.model(idx, targets), expected)


def test_gpt2_dropout_is_applied_in_train_mode_only():
    wl = build("gpt2", dropout=0.2)
    batch = wl.make_batch(0)
    torch.manual_seed(0)
    train_a = wl.step_loss(wl.model, batch)
    torch.manual_seed(0)
    train_b = wl.step_loss(wl.model, batch)
    wl.model.eval()
    eval_loss = wl.step_loss(wl.model, batch)
    no_dropout = build("gpt2", dropout=0.0)
    no_dropout.model.eval()
    assert torch.equal(train_a, train_b)
    assert not torch.equal(train_a, eval_loss)
    assert torch.equal(eval_loss, no_dropout.step_loss(no_dropout.model, batch))


def test_gpt2_chunked_loss_matches_and_stays_one_fx_call():
    plain, chunked = build("gpt2"), build("gpt2", chunked_loss=True)
    loss, grads = step(plain)
    chunked_loss, chunked_grads = step(chunked)
    torch.testing.assert_close(chunked_loss, loss, rtol=1e-5, atol=1e-6)
    for pname, grad in grads.items():
        torch.testing.assert_close(chunked_grads[pname], grad, rtol=1e-4, atol=1e-6)
    traced = torch.fx.symbolic_trace(chunked.model)
    targets = [n.target for n in traced.graph.nodes if n.op == "call_function"]
    assert sum(getattr(t, "__name__", "") == "chunked_lm_loss" for t in targets) == 1
    assert torch.equal(traced(*chunked.make_batch(0).args), chunked_loss)


def test_unet_down_blocks_push_skips_and_up_blocks_pop_them():
    wl = build("unet")
    lengths = []
    handles = [
        b.register_forward_hook(lambda m, a, out: lengths.append(len(out))) for b in wl.blocks
    ]
    step(wl)
    for h in handles:
        h.remove()
    kinds = [type(b).__name__ for b in wl.blocks]
    n_down = kinds.count("DownBlock")
    assert kinds == ["DownBlock"] * n_down + ["MidBlock"] + ["UpBlock"] * (len(kinds) - n_down - 1)
    # state = (h, emb, *skips): conv_in's skip plus one per down block, then one popped per up block
    assert lengths[:n_down] == [3 + i for i in range(1, n_down + 1)]
    assert lengths[n_down] == 3 + n_down
    assert lengths[-1] == 2


def dag(**overrides):
    return build("synthetic_dag", **overrides).model


def test_synthetic_dag_chain_has_one_edge_per_layer_and_unit_frontier():
    model = dag(depth=7, width=1, skip_prob=0.0)
    assert model.edges == [(i, i + 1) for i in range(6)]
    assert model.frontier_sizes() == [1] * 7


def test_synthetic_dag_edge_counts_from_no_skips_to_all_skips():
    depth, width = 6, 3
    no_skips = dag(depth=depth, width=width, skip_prob=0.0)
    all_skips = dag(depth=depth, width=width, skip_prob=1.0)
    some = dag(depth=depth, width=width, skip_prob=0.3)
    assert len(no_skips.edges) == width * width * (depth - 1)
    assert len(all_skips.edges) == width * width * depth * (depth - 1) // 2
    assert len(no_skips.edges) < len(some.edges) < len(all_skips.edges)
    assert no_skips.frontier_sizes() == [width] * depth
    # With every long skip, layers 0..k all stay alive after layer k; the readout needs the last.
    assert all_skips.frontier_sizes() == [(layer + 1) * width for layer in range(depth - 1)] + [
        width
    ]


def test_synthetic_dag_graph_depends_on_graph_seed_only():
    a = build("synthetic_dag", seed=0, skip_prob=0.5)
    b = build("synthetic_dag", seed=1, skip_prob=0.5)
    c = build("synthetic_dag", seed=0, skip_prob=0.5, graph_seed=1)
    assert a.model.edges == b.model.edges and a.model.edges != c.model.edges
    hidden = [b.fc1.out_features for layer in a.blocks for b in layer.nodes]
    base, jitter = a.config["hidden"], a.config["hidden_jitter"]
    assert len(set(hidden)) > 1
    assert all(base * (1 - jitter) - 1 <= h <= base * (1 + jitter) + 1 for h in hidden)
    flat = [b.fc1.out_features for layer in dag(hidden_jitter=0.0).blocks for b in layer.nodes]
    assert set(flat) == {a.config["hidden"]}


def test_synthetic_dag_nodes_read_exactly_their_edges():
    model = dag(depth=6, width=2, skip_prob=0.4)
    graph, width = model.graph, 2
    outputs, inputs = {}, {}
    handles = []
    for layer_index, layer in enumerate(model.blocks):
        for k, node in enumerate(layer.nodes):
            node_id = layer_index * width + k

            def hook(module, args, output, node_id=node_id):
                inputs[node_id], outputs[node_id] = args[0], output

            handles.append(node.register_forward_hook(hook))
    x = torch.randn(4, 64)
    model(x)
    for h in handles:
        h.remove()
    assert len(outputs) == 12
    for node_id, read in inputs.items():
        sources = graph.inputs(node_id)
        expected = [outputs[s] for s in sources] if sources else [x]
        assert len(read) == len(expected) and all(r is e for r, e in zip(read, expected)), node_id


@pytest.mark.slow
def test_gpt2_medium_forward_with_a_tiny_batch():
    wl = build("gpt2", "medium", batch_size=1, seq_len=32)
    assert wl.config["params"] == 124_439_808 - (1024 - 32) * 768
    idx, targets = wl.make_batch(0).args
    with torch.no_grad():
        loss = wl.model(idx, targets)
    # Random init predicts near-uniformly over the 50257-token vocabulary.
    assert abs(loss.item() - math.log(50257)) < 0.5


@pytest.mark.parametrize("name", WORKLOADS)
def test_small_profiles_are_activation_dominated(name):
    """The small profiles exist to benchmark activation memory: a step's peak must be mostly
    activations, not parameter gradients (exact CPU bytes, by the live-storage tracker)."""
    wl = build(name)
    batch = wl.make_batch(0)

    def training_step():
        wl.step_loss(wl.model, batch).backward()

    _, peak = measure_callable_peak(training_step)
    param_grad_bytes = wl.config["param_bytes"]
    # diffusers' UNet at 16x16 latents is heavier in parameters (cross-attention, GEGLU
    # feed-forwards): activations are ~3.5x its parameter gradients.
    ratio = 3 if name == "diffusers_unet" else 4
    assert peak - param_grad_bytes >= ratio * param_grad_bytes
