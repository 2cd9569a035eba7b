"""`hbp.estimate`: "will it fit?" from capture and simulation only, checked against the
allocator's peak of the step it predicts (within 3%)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from models.traits import DataDependentTail
from torch import nn

import hbp
from hbp.allocator import allocator_peak
from hbp.errors import BudgetError, CaptureWarning, ConfigError
from hbp.estimate import Estimate, main


class ConvClassifier(nn.Module):
    def __init__(self, c=32):
        super().__init__()
        self.blocks = nn.Sequential(
            *[
                m
                for _ in range(6)
                for m in (nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
            ]
        )
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def setup():
    torch.manual_seed(0)
    return ConvClassifier(), torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))


def test_estimate_agrees_with_measured_steps_within_3_percent():
    model, x, y = setup()
    est = hbp.estimate(model, x, loss_fn=F.cross_entropy, targets=y, budgets=[1.0, 0.5, "min"])
    assert isinstance(est, Estimate) and est.granularity == "op"
    model.zero_grad(set_to_none=True)
    _, naive = allocator_peak(lambda: F.cross_entropy(model(x), y).backward())
    assert abs(est.naive_peak_bytes - naive) <= 0.03 * naive
    by_budget = {p.budget: p for p in est.frontier}
    assert set(by_budget) == {1.0, 0.5, "min"}
    assert by_budget["min"].budget_bytes == est.min_peak_bytes
    assert by_budget[1.0].recompute_flops == 0 < by_budget["min"].recompute_flops
    for budget in (0.5, "min"):
        hc = hbp.HCModule(model, budget, loss_fn=F.cross_entropy)
        hc.prepare(x, targets=y)
        model.zero_grad(set_to_none=True)
        _, measured = allocator_peak(lambda hc=hc: hc(x, targets=y).backward())
        assert abs(by_budget[budget].predicted_peak_bytes - measured) <= 0.03 * measured
    # the least reachable peak is HCModule's BudgetError.minimum
    with pytest.raises(BudgetError) as err:
        hbp.HCModule(model, 1, loss_fn=F.cross_entropy).prepare(x, targets=y)
    assert err.value.minimum == est.min_peak_bytes
    assert est.fits(0.5) and est.fits(est.min_peak_bytes) and not est.fits(est.min_peak_bytes - 1)
    assert "least reachable" in str(est)


def test_a_budget_below_the_least_is_listed_as_not_fitting():
    model, x, y = setup()
    est = hbp.estimate(model, x, loss_fn=F.cross_entropy, targets=y, budgets=["1KiB", 0.9])
    assert [p.budget for p in est.frontier] == [0.9]
    assert est.below_minimum == [("1KiB", 1024)] and not est.fits("1KiB")
    assert "1KiB" in str(est) and "does not fit" in str(est)


def test_the_default_frontier_holds_the_default_budget_as_hcmodule_resolves_it():
    """Without `budgets`, the frontier has the default budget of `hbp.enable` and HCModule
    ("50%act") among the fractions, at the bytes HCModule resolves it to, and says so."""
    model, x, y = setup()
    est = hbp.estimate(model, x, loss_fn=F.cross_entropy, targets=y)
    by_budget = {p.budget: p for p in est.frontier}
    assert {1.0, 0.75, "50%act", "min"} <= set(by_budget)
    assert [p.budget_bytes for p in est.frontier] == sorted(
        (p.budget_bytes for p in est.frontier), reverse=True
    )
    hc = hbp.HCModule(model, loss_fn=F.cross_entropy)
    hc.prepare(x, targets=y)
    default = by_budget["50%act"]
    assert default.budget_bytes == hc.budget_bytes
    assert default.predicted_peak_bytes == hc.plan.predicted_peak_bytes <= hc.budget_bytes
    assert "50%act: the default budget of hbp.enable and HCModule" in str(est)


def test_estimate_without_loss_and_module_state_kept():
    model, x, _ = setup()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    est = hbp.estimate(model, x, budgets=[0.5])
    assert est.frontier[0].predicted_peak_bytes <= est.frontier[0].budget_bytes
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ConfigError, match="loss_fn"):
        hbp.estimate(model, x, loss_fn="ce")
    one = hbp.estimate(model, x, budgets=0.5)  # one budget, not in a list
    assert [p.budget for p in one.frontier] == [0.5]
    assert one.frontier[0].budget_bytes == est.frontier[0].budget_bytes
    with pytest.raises(ConfigError, match="budgets"):
        hbp.estimate(model, x, budgets={0.5})


def test_command_line_on_a_workload_config(capsys):
    argv = ["workload=gpt2", "profile=small", "budgets=0.5,min", "workload.n_layer=1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "workload=gpt2" in out and "least reachable" in out and "min" in out
    assert "as the bench's modes build it (the full LM head)" in out
    for bad, field in (
        (["budgets=0.5"], "workload=NAME"),
        (["workload=gpt2", "threads=0"], "threads"),
    ):
        assert main(bad) == 2  # one line on stderr, as run.py's errors
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("error: ") and field in line
    assert main(["--help"]) == 0 and capsys.readouterr().out.startswith("usage: ")


def test_a_module_level_structure_is_planned_once_per_budget(monkeypatch):
    """An estimate of two budgets and then HCModule's "min" on the same model ask the planner
    each budget of the module graph once (NOTE [ Module-level plans are remembered ])."""
    import hbp.planner
    from hbp.planner import module_level

    monkeypatch.setattr(module_level, "_PLANNED", {})
    asked, real = [], hbp.planner.plan
    monkeypatch.setattr(
        hbp.planner,
        "plan",
        lambda graph, budget, **kw: asked.append(budget) or real(graph, budget, **kw),
    )
    torch.manual_seed(0)
    model, x = DataDependentTail(), torch.randn(256, 64)
    with pytest.warns(CaptureWarning, match="could not capture DataDependentTail at"):
        hbp.estimate(model, x, loss_fn=lambda out: out.square().mean())  # not "WithLoss"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CaptureWarning)
        est = hbp.estimate(model, x, budgets=(0.75, "min"))
        planned = list(asked)
        hc = hbp.HCModule(model, budget="min")
        hc(x).square().mean().backward()
    assert sorted(map(str, planned)) == sorted(set(map(str, planned))) and len(planned) >= 8
    assert asked == planned  # nothing planned again
    assert hc.plan.budget_bytes == est.min_peak_bytes


class _HeadAfterBranchlessBlocks(nn.Module):
    """Six residual MLP blocks and a head, then a data-dependent branch (module level)."""

    def __init__(self, d=128):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(6)
        )
        self.head = nn.Linear(d, d)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        x = self.head(x)
        return x * 2 if x.sum() > 0 else x


def test_module_level_min_is_the_least_recompute_at_the_least_peak():
    """Several executable plans reach the module graph's least peak: "min" runs the one with
    the least recompute, as a byte budget of that peak does, and its recompute is a share
    of the plain step's FLOPs (forward and backward), as at op level."""
    torch.manual_seed(0)
    model, x = _HeadAfterBranchlessBlocks(), torch.randn(512, 128)
    plans = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CaptureWarning)
        for budget in ("min", None):
            budget = plans["min"].budget_bytes if budget is None else budget
            hc = hbp.HCModule(model, budget=budget)
            hc(x).square().mean().backward()
            assert hc.captured.granularity == "module"
            plans[budget] = hc.plan
    least, as_bytes = plans["min"], plans[plans["min"].budget_bytes]
    assert least.predicted_peak_bytes == as_bytes.predicted_peak_bytes
    assert least.predicted_recompute_flops == as_bytes.predicted_recompute_flops
    assert least.meta["solved_by"] == "least recompute"
    assert 0 < least.predicted_recompute_ratio < 0.5


def test_estimate_of_a_module_level_fallback_is_what_hcmodule_reaches():
    torch.manual_seed(0)
    model, x = DataDependentTail(), torch.randn(256, 64)
    with pytest.warns(CaptureWarning, match="could not capture DataDependentTail at"):
        hbp.estimate(model, x, loss_fn=lambda out: out.square().mean())  # not "WithLoss"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CaptureWarning)
        est = hbp.estimate(model, x, budgets=(0.75, "min"))
        hc = hbp.HCModule(model, budget="min")
        hc(x).square().mean().backward()
        assert hc.captured.granularity == "module"
        assert est.granularity == "module"
        assert est.min_peak_bytes == hc.plan.budget_bytes
        below = est.min_peak_bytes - 4096
        with pytest.raises(BudgetError) as info:
            hbp.HCModule(model, budget=below)(x)
    assert info.value.minimum == est.min_peak_bytes
    assert not est.fits(below) and est.fits(est.min_peak_bytes)
    (least,) = [p for p in est.frontier if p.budget == "min"]
    assert least.predicted_peak_bytes == est.min_peak_bytes


def test_estimating_again_with_a_plan_cache_measures_and_plans_nothing(tmp_path, monkeypatch):
    import hbp.graph.torch.calibrate as calibrate
    import hbp.planner as planner

    model, x, y = setup()
    first = hbp.estimate(model, x, loss_fn=F.cross_entropy, targets=y, plan_cache=tmp_path)
    calibrate.clear_cache()
    ran, planned = [], []
    run_node, plan = calibrate.run_node, planner._plan
    monkeypatch.setattr(calibrate, "run_node", lambda *a: ran.append(1) or run_node(*a))
    monkeypatch.setattr(planner, "_plan", lambda *a, **k: planned.append(1) or plan(*a, **k))
    again = hbp.estimate(model, x, loss_fn=F.cross_entropy, targets=y, plan_cache=tmp_path)
    assert ran == [] and planned == []
    assert again.naive_peak_bytes == first.naive_peak_bytes
    assert again.min_peak_bytes == first.min_peak_bytes
    assert [p.predicted_peak_bytes for p in again.frontier] == [
        p.predicted_peak_bytes for p in first.frontier
    ]
    with pytest.raises(ConfigError, match="plan_cache"):
        hbp.estimate(model, x, plan_cache="")


class _TransposedBatchNorm(nn.Module):
    """A batch norm over channels of (batch, length, channels) values, as time-series and
    audio models write it: transposed in, transposed back, then a linear."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn, self.out = nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Linear(32, 32)

    def forward(self, x):
        h = self.bn(self.lin(x).transpose(1, 2)).transpose(1, 2)
        return self.out(torch.relu(h))


def test_a_batch_norm_of_a_transposed_input_is_estimated_to_the_allocators_bytes():
    """NOTE [ A batch norm's output layout ]: the real kernel returns a contiguous output, so
    the linear after the transpose back copies its input and saves the copy; the estimate
    (and every plan) counts it: one activation was missing."""
    torch.manual_seed(0)
    model, x = _TransposedBatchNorm(), torch.randn(6, 40, 32)

    def loss_fn(out):
        return out.square().mean()

    def step():
        model.zero_grad(set_to_none=True)
        loss_fn(model(x)).backward()

    step()
    _, measured = allocator_peak(step)
    est = hbp.estimate(model, x, loss_fn=loss_fn, budgets=["min"])
    assert abs(est.naive_peak_bytes - measured) <= 64, (est.naive_peak_bytes, measured)
