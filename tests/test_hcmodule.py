"""hbp.HCModule on models beyond the four workloads: same outputs and gradients as the plain
model (bitwise where the ops are deterministic), same dropout masks, BatchNorm statistics
updated once per step, in-place ops, keyword arguments, tuple/dict outputs, tied weights,
frozen parameters, inputs without grad, a data-dependent model (module-level fallback); the
measured peak within the budget; recomputation that really happens; BudgetError; plan
caching per input signature."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves

import hbp
from hbp.analysis.simulate import simulate
from hbp.errors import BudgetError, CaptureWarning
from hbp.graph.ir import Graph
from hbp.runtime.flops import TotalFlopCounterMode
from hbp.runtime.tracker import MemoryTracker

D = 64


class DropoutMLP(nn.Module):
    def __init__(self, depth=6, width=128):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(D if i == 0 else width, width), nn.GELU(), nn.Dropout(0.3))
            for i in range(depth)
        )
        self.out = nn.Linear(width, D)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            *[
                m
                for cin, cout in [(3, 8), (8, 16), (16, 16), (16, 16)]
                for m in (nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(True))
            ]
        )
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        h = self.features(x)
        h = F.relu(h + self.features[-2](self.features[-3](h)), inplace=True)  # BN runs twice
        return self.fc(h.mean((2, 3)))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.drop = nn.Dropout(0.1)

    def forward(self, x, *, attn_mask=None, return_attn_input=False):
        b, t, _ = x.shape
        q, k, v = (
            h.view(b, t, 4, D // 4).transpose(1, 2) for h in self.qkv(self.ln1(x)).split(D, -1)
        )
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, D)))
        out = {"hidden": x + self.mlp(self.ln2(x)), "norms": (x.norm(), x.abs().mean())}
        if return_attn_input:
            out["attn_input"] = q
        return out


class TiedLM(nn.Module):
    def __init__(self, vocab=50):
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(4)])
        self.head = nn.Linear(D, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.frozen = nn.Linear(D, D)
        self.frozen.requires_grad_(False)

    def forward(self, idx, targets):
        h = self.body(self.emb(idx))
        h = h + self.frozen(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten()), h


class MLPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(D, D)
        self.blocks = nn.Sequential(*[MLPBlock() for _ in range(6)])

    def forward(self, x):
        h = self.pre(x)
        if h.mean() > 100:  # data-dependent control flow: op-level capture fails
            h = h.flip(0)
        return self.blocks(h)


def step(module, params, *inputs, seed=0, **kwargs):
    """One training step: (outputs detached, grads, peak bytes, FLOPs)."""
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    with TotalFlopCounterMode() as fc, MemoryTracker(record_timeline=False) as tracker:
        out = module(*inputs, **kwargs)
        loss = sum(t.float().sum() for t in tree_leaves(out) if t.requires_grad)
        loss.backward()
    outs = [t.detach() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    return outs, [p.grad for p in params], tracker.peak_bytes, fc.get_total_flops()


def assert_same(a, b, exact=True):
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            assert x is None and y is None
        elif exact:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_dropout_mlp_same_results_and_masks_less_memory_more_flops():
    torch.manual_seed(0)
    model = DropoutMLP()
    x = torch.randn(256, D, requires_grad=True)
    params = [x, *model.parameters()]
    masks = {"plain": [], "hc": []}
    key = ["plain"]
    # the masks as bytes, not tensors: tensors kept by the hook would count in the peak
    model.layers[2][2].register_forward_hook(
        lambda m, i, o: masks[key[0]].append(bytes((o == 0).numpy()))
    )
    plain = step(model, params, x)
    hc = hbp.HCModule(model, budget=0.4)
    key[0] = "hc"
    with pytest.warns(UserWarning, match="forward hooks on layers.2.2 run again"):
        got = step(hc, params, x)
    assert_same(plain[0], got[0])
    assert_same(plain[1], got[1])
    assert len(masks["hc"]) > 1  # the forward's dropout mask and the recomputes'...
    assert all(masks["plain"][0] == m for m in masks["hc"])  # ...are the plain step's
    plan = hc.plan
    assert any(s.recompute for s in plan.segments)
    assert got[2] <= 1.05 * plan.budget_bytes  # measured peak within the budget
    assert got[2] < 0.6 * plain[2]
    # Recomputation really happens and costs at most the predicted FLOPs (non-reentrant
    # checkpoint's early stop can skip the last op of a recompute pass: its inputs, the only
    # thing it saves, are packed before it runs).
    assert 0 < got[3] - plain[3] <= plan.predicted_recompute_flops


def test_convnet_batchnorm_updated_once_and_in_place_relu():
    torch.manual_seed(0)
    model, reference = ConvBN(), ConvBN()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(8, 3, 16, 16)
    hc = hbp.HCModule(model, budget=0.6)  # the minimum is 0.50 of naive
    got = step(hc, list(model.parameters()), x)
    expected = step(reference, list(reference.parameters()), x)
    assert any(s.recompute for s in hc.plan.segments)
    assert_same(expected[0], got[0])
    assert_same(expected[1], got[1], exact=False)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name  # running stats and num_batches_tracked: one update
    assert model.features[1].num_batches_tracked.item() == 1
    assert model.features[-2].num_batches_tracked.item() == 2  # called twice per forward


def test_transformer_block_with_kwargs_and_dict_outputs():
    torch.manual_seed(0)
    model = TransformerBlock()
    x = torch.randn(16, 64, D, requires_grad=True)
    mask = torch.ones(64, 64, dtype=torch.bool).tril()
    params = [x, *model.parameters()]
    hc = hbp.HCModule(model, budget=0.8)  # one block: little to gain, but some
    out = hc(x, attn_mask=mask, return_attn_input=True)
    assert set(out) == {"hidden", "norms", "attn_input"} and isinstance(out["norms"], tuple)
    expected = step(model, params, x, attn_mask=mask, return_attn_input=True)
    got = step(hc, params, x, attn_mask=mask, return_attn_input=True)
    assert_same(expected[0], got[0])
    assert_same(expected[1], got[1])
    assert any(s.recompute for s in hc.plan.segments)


def test_tied_weights_frozen_parameters_and_integer_inputs():
    torch.manual_seed(0)
    model = TiedLM()
    idx, targets = torch.randint(0, 50, (16, 24)), torch.randint(0, 50, (16, 24))
    params = list(model.parameters())
    expected = step(model, params, idx, targets)
    hc = hbp.HCModule(model, budget=0.7)
    got = step(hc, params, idx, targets)
    assert_same(expected[0], got[0])
    assert_same(expected[1], got[1])
    assert model.frozen.weight.grad is None and model.frozen.bias.grad is None
    assert model.emb.weight.grad is not None  # tied: embedding + head contributions summed


def test_input_that_does_not_require_grad_and_one_that_does():
    torch.manual_seed(0)
    model = DropoutMLP(depth=3)
    x = torch.randn(256, D)
    hc = hbp.HCModule(model, budget=0.6)
    expected = step(model, list(model.parameters()), x)
    got = step(hc, list(model.parameters()), x)
    assert_same(expected[1], got[1])
    assert hc.captured.graph.nodes[0].requires_grad is False
    y = torch.randn(256, D, requires_grad=True)
    expected = step(model, [y], y)
    got = step(hc, [y], y)
    assert_same(expected[1], got[1])


def test_data_dependent_model_falls_back_to_module_level_with_a_warning():
    torch.manual_seed(0)
    model = DataDependent()
    x = torch.randn(256, D, requires_grad=True)
    params = [x, *model.parameters()]
    expected = step(model, params, x)
    hc = hbp.HCModule(model, budget="min")
    with pytest.warns(CaptureWarning, match="module-level"):
        got = step(hc, params, x)
    assert hc.captured.granularity == "module"
    assert_same(expected[0], got[0])
    assert_same(expected[1], got[1])
    assert got[3] > expected[3]  # child calls were recomputed


def test_infeasible_budget_raises_budget_error_with_the_minimum():
    model = DropoutMLP(depth=2)
    hc = hbp.HCModule(model, budget=1000)  # 1000 bytes
    with pytest.raises(BudgetError, match="MiB") as info:
        hc(torch.randn(32, D))
    assert info.value.minimum > 1000 and info.value.budget == 1000
    with pytest.raises(hbp.ConfigError, match="budget"):
        hbp.HCModule(model, budget="lots")


def test_plans_once_per_signature_and_runs_plainly_in_eval_or_no_grad(count_captures):
    model = DropoutMLP(depth=2)
    captures = count_captures()
    hc = hbp.HCModule(model, budget=1.0)
    x = torch.randn(16, D)
    hc(x).sum().backward()
    hc(x).sum().backward()
    assert len(captures) == 1  # same signature: cached
    first = hc.plan
    hc(torch.randn(32, D)).sum().backward()
    assert len(captures) == 2 and hc.plan is not first  # new shape: planned again
    hc(x.requires_grad_()).sum().backward()
    assert len(captures) == 3  # requires_grad is part of the signature
    with torch.no_grad():
        hc(x)
    hc.eval()
    hc(x)
    assert len(captures) == 3
    assert not model.training  # .eval() passes through
    assert set(hc.state_dict()) == set(model.state_dict())  # the plain model's keys


def test_plan_summary_is_readable():
    hc = hbp.HCModule(DropoutMLP(depth=3), budget=0.6)
    plan = hc.prepare(torch.randn(256, D))
    text = hc.summary()
    assert text.startswith("HCModule: op-level capture")
    assert str(plan) in text and "predicted peak" in text and "recompute" in text
    assert plan.predicted_peak_bytes <= plan.budget_bytes


def test_tiny_mode_plans_on_apply_and_reports_the_plan():
    import json

    from hbp.modes import build_mode
    from hbp.workloads.base import Batch, Workload

    torch.manual_seed(0)
    model = DropoutMLP(depth=4)
    workload = Workload(
        name="mlp",
        profile="test",
        model=model,
        make_batch=lambda seed: Batch(args=(torch.randn(256, D),), targets=torch.randn(256, D)),
        loss_fn=lambda out, batch: F.mse_loss(out, batch.targets),
    )
    batch = workload.make_batch(0)
    mode = build_mode({"name": "tiny", "budget": 0.5, "block_size": 1, "chunked_loss": False})
    module = mode.apply(workload, batch)
    assert isinstance(module, hbp.HCModule) and module.module is model
    info = mode.describe()
    assert info["capture_granularity"] == "op" and info["plan_segments"] >= 2
    assert info["predicted_peak_bytes"] <= info["budget_bytes"] < info["naive_predicted_peak_bytes"]
    assert 0 < info["predicted_recompute_ratio"] < 1 and info["plan_time_s"] > 0
    assert json.loads(json.dumps(info)) == info  # flat and JSON-serialisable
    plan = json.loads(mode.artifacts()["plan.json"])
    assert plan["predicted_peak_bytes"] == info["predicted_peak_bytes"]
    graph = Graph.from_json(mode.artifacts()["graph.json"])  # what `hbp.optimum graph=` reads
    assert simulate(graph).peak_bytes == info["naive_predicted_peak_bytes"]
    torch.manual_seed(1)
    expected = workload.step_loss(model, batch)
    torch.manual_seed(1)
    assert torch.equal(workload.step_loss(module, batch), expected)
    with pytest.raises(hbp.ConfigError, match="mode.block_size"):
        build_mode({"name": "tiny", "block_size": 0})
