"""Modes: the registry, uniform segmenting, and checkpoint mode's contract (same gradients
as plain autograd, BatchNorm statistics updated once, less memory, more FLOPs)."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from models.toy import D, DropoutMLP
from torch import nn

import hbp
from hbp.analysis.simulate import simulate
from hbp.errors import ConfigError
from hbp.graph.ir import Graph
from hbp.modes import MODES, build_mode, mode_class
from hbp.modes.checkpoint import CheckpointedSegment, CheckpointMode, segment_bounds
from hbp.modes.naive import NaiveMode
from hbp.runtime.flops import count_flops
from hbp.runtime.tracker import MemoryTracker
from hbp.workloads.base import Batch, Workload

# -- registry ---------------------------------------------------------------------------------


def test_registry_names_every_mode_of_the_bench():
    assert {"naive", "checkpoint", "tiny", "sac", "compile_budget"} <= set(MODES)
    assert mode_class("naive") is NaiveMode
    assert mode_class("checkpoint") is CheckpointMode


def test_build_mode_from_name_and_mapping():
    assert isinstance(build_mode("naive"), NaiveMode)
    mode = build_mode({"name": "checkpoint", "segments": 3, "block_size": None})
    assert isinstance(mode, CheckpointMode) and mode.segments == 3


def test_unknown_mode_lists_the_registered_names():
    with pytest.raises(ConfigError) as info:
        build_mode({"name": "fast"})
    message = str(info.value)
    assert info.value.field == "mode" and "'fast'" in message
    for name in ("naive", "checkpoint", "tiny"):
        assert name in message


def test_unknown_mode_key_lists_the_accepted_parameters():
    with pytest.raises(ConfigError) as info:
        build_mode({"name": "checkpoint", "segmnts": 2})
    assert info.value.field == "mode.segmnts"
    assert "segments" in str(info.value) and "block_size" in str(info.value)


@pytest.mark.parametrize(
    "params, field",
    [
        ({"segments": 0}, "mode.segments"),
        ({"block_size": -1}, "mode.block_size"),
        ({"segments": 2.5}, "mode.segments"),
        ({"segments": 2, "block_size": 2}, "mode.segments/mode.block_size"),
    ],
)
def test_bad_checkpoint_parameters(params, field):
    with pytest.raises(ConfigError) as info:
        CheckpointMode(**params)
    assert info.value.field == field


# -- segmenting -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_blocks, segments, block_size, expected",
    [
        (9, None, None, [(0, 3), (3, 6), (6, 9)]),  # round(sqrt(9)) = 3
        (12, None, None, [(0, 4), (4, 8), (8, 12)]),  # round(sqrt(12)) = 3
        (8, None, None, [(0, 3), (3, 6), (6, 8)]),  # round(sqrt(8)) = 3, longer first
        (1, None, None, [(0, 1)]),
        (5, 2, None, [(0, 3), (3, 5)]),
        (3, 10, None, [(0, 1), (1, 2), (2, 3)]),  # clamped to one block per segment
        (7, None, 3, [(0, 3), (3, 6), (6, 7)]),
        (4, None, 8, [(0, 4)]),
    ],
)
def test_segment_bounds(num_blocks, segments, block_size, expected):
    assert segment_bounds(num_blocks, segments, block_size) == expected


# -- checkpoint mode on stand-in workloads ----------------------------------------------------


class ConvBlock(nn.Module):
    """BatchNorm (running stats) + dropout (RNG) + residual; state is a tensor."""

    def __init__(self, width):
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.norm = nn.BatchNorm2d(width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(torch.relu(self.norm(self.conv(x))))


class PairBlock(nn.Module):
    """State is a tuple (h, skip): a long skip carried through the blocks."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, state):
        h, skip = state
        h = torch.tanh(self.lin(h)) + 0.5 * skip
        return self.drop(h), skip


class ConvNet(nn.Module):
    def __init__(self, width=8, depth=6):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 5)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=(2, 3)))


class PairNet(nn.Module):
    def __init__(self, width=64, depth=9):
        super().__init__()
        self.blocks = nn.ModuleList(PairBlock(width) for _ in range(depth))

    def forward(self, x):
        state = (x, x)
        for block in self.blocks:
            state = block(state)
        h, _ = state
        return h.pow(2).mean()


def conv_workload(seed=0) -> Workload:
    torch.manual_seed(seed)
    model = ConvNet().train()

    def make_batch(s):
        g = torch.Generator().manual_seed(s)
        return Batch(
            args=(torch.randn(16, 3, 16, 16, generator=g),),
            targets=torch.randint(0, 5, (16,), generator=g),
        )

    def loss_fn(out, batch):
        return nn.functional.cross_entropy(out, batch.targets)

    return Workload("conv", "test", model, make_batch, loss_fn)


def pair_workload(seed=0) -> Workload:
    torch.manual_seed(seed)
    model = PairNet().train()

    def make_batch(s):
        return Batch(args=(torch.randn(256, 64, generator=torch.Generator().manual_seed(s)),))

    return Workload("pair", "test", model, make_batch, lambda out, batch: out)


def step_grads(workload, module, batch, seed=1):
    for p in workload.model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    workload.step_loss(module, batch).backward()
    return [p.grad.clone() for p in workload.model.parameters()]


@pytest.mark.parametrize("make", [conv_workload, pair_workload])
@pytest.mark.parametrize("params", [{}, {"segments": 2}, {"block_size": 1}, {"segments": 1}])
def test_checkpoint_gradients_equal_naive(make, params):
    naive, ckpt = make(), make()
    batch = naive.make_batch(0)
    mode = CheckpointMode(**params)
    module = mode.apply(ckpt, batch)
    expected = step_grads(naive, naive.model, batch)
    got = step_grads(ckpt, module, batch)
    assert len(got) == len(expected)
    for g, r in zip(got, expected):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


def test_checkpoint_keeps_the_same_parameter_objects_and_blocks():
    workload = conv_workload()
    before = list(workload.model.parameters())
    blocks = list(workload.model.blocks)
    mode = CheckpointMode(segments=2)
    module = mode.apply(workload, workload.make_batch(0))
    assert module is workload.model
    assert all(a is b for a, b in zip(before, workload.model.parameters()))
    assert len(list(workload.model.parameters())) == len(before)
    segments = list(workload.model.blocks)
    assert all(isinstance(s, CheckpointedSegment) for s in segments)
    assert [b for s in segments for b in s.blocks] == blocks
    assert mode.describe() == {
        "name": "checkpoint",
        "segments": 2,
        "block_size": None,
        "chunked_loss": False,
        "num_blocks": 6,
        "num_segments": 2,
        "segment_sizes": "3,3",
    }


def test_batchnorm_running_stats_updated_once_per_step():
    naive, ckpt = conv_workload(), conv_workload()
    batch = naive.make_batch(0)
    module = CheckpointMode(block_size=2).apply(ckpt, batch)
    for _ in range(2):
        step_grads(naive, naive.model, batch)
        step_grads(ckpt, module, batch)
    naive_norms = [m for m in naive.model.modules() if isinstance(m, nn.BatchNorm2d)]
    ckpt_norms = [m for m in ckpt.model.modules() if isinstance(m, nn.BatchNorm2d)]
    for a, b in zip(naive_norms, ckpt_norms):
        assert int(b.num_batches_tracked) == int(a.num_batches_tracked) == 2
        torch.testing.assert_close(b.running_mean, a.running_mean)
        torch.testing.assert_close(b.running_var, a.running_var)


@pytest.mark.parametrize("make", [conv_workload, pair_workload])
def test_checkpoint_lowers_peak_and_adds_flops(make):
    def measure(workload, module, batch):
        for p in workload.model.parameters():
            p.grad = None

        def step():
            workload.step_loss(module, batch).backward()

        with MemoryTracker(record_timeline=False) as tracker:
            step()
        for p in workload.model.parameters():
            p.grad = None
        _, flops = count_flops(step)
        return tracker.peak_bytes, flops

    naive, ckpt = make(), make()
    batch = naive.make_batch(0)
    module = CheckpointMode().apply(ckpt, batch)
    naive_peak, naive_flops = measure(naive, naive.model, batch)
    ckpt_peak, ckpt_flops = measure(ckpt, module, batch)
    assert ckpt_peak < naive_peak
    assert ckpt_flops > naive_flops


def test_no_grad_forward_runs_without_checkpoint():
    workload = pair_workload()
    reference = copy.deepcopy(workload.model).eval()
    module = CheckpointMode(segments=3).apply(workload, workload.make_batch(0))
    module.eval()
    x = workload.make_batch(0).args[0]
    with torch.no_grad():
        torch.testing.assert_close(module(x), reference(x))


def test_naive_mode_returns_the_model():
    workload = pair_workload()
    mode = NaiveMode(chunked_loss=True)
    assert mode.apply(workload, workload.make_batch(0)) is workload.model
    assert mode.describe() == {"name": "naive", "chunked_loss": True}


# -- checkpoint mode on the real workloads ----------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "resnet", "unet", "synthetic_dag"])
def test_checkpoint_on_workload_matches_naive_gradients(name):
    from hbp.bench import max_relative_grad_error
    from hbp.workloads import build

    naive, ckpt = build(name, "small", seed=0), build(name, "small", seed=0)
    batch = naive.make_batch(0)
    module = CheckpointMode().apply(ckpt, batch)
    error = max_relative_grad_error(
        step_grads(ckpt, module, batch), step_grads(naive, naive.model, batch)
    )
    assert error < 1e-5


def _mlp_workload() -> tuple[Workload, Batch]:
    """A 4-layer dropout MLP with an MSE loss as a workload, and its batch."""
    torch.manual_seed(0)
    workload = Workload(
        name="mlp",
        profile="test",
        model=DropoutMLP(depth=4),
        make_batch=lambda seed: Batch(args=(torch.randn(256, D),), targets=torch.randn(256, D)),
        loss_fn=lambda out, batch: F.mse_loss(out, batch.targets),
    )
    return workload, workload.make_batch(0)


def test_tiny_mode_plans_on_apply_and_reports_the_plan():
    workload, batch = _mlp_workload()
    model = workload.model
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


def test_tiny_mode_with_a_plan_cache_reads_the_plan_a_run_before_made(tmp_path):
    """`mode.plan_cache`: the second run on the same graph and budget reads the first run's
    plan (`plan_from_cache`) and plans nothing; another budget plans and keeps its own."""

    workload, batch = _mlp_workload()
    runs = []
    for budget in (0.5, 0.5, "min"):
        mode = build_mode({"name": "tiny", "budget": budget, "plan_cache": str(tmp_path)})
        mode.apply(workload, batch)
        runs.append(mode.describe())
    first, again, other = runs
    assert (first["plan_from_cache"], again["plan_from_cache"], other["plan_from_cache"]) == (
        False,
        True,
        False,
    )
    assert again["predicted_peak_bytes"] == first["predicted_peak_bytes"]
    assert again["plan_segments"] == first["plan_segments"]
    assert other["predicted_peak_bytes"] < first["predicted_peak_bytes"]
    assert len(list(tmp_path.glob("*.json"))) == 2  # one plan per budget
    assert list((tmp_path / "scratch").rglob("*.json"))  # and the measured workspaces
    with pytest.raises(hbp.ConfigError, match="mode.plan_cache"):
        build_mode({"name": "tiny", "plan_cache": 3})
