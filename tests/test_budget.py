"""Budgets as users name them (`hbp.Budget`, hbp/planner/budget.py's table): every form parses
once, resolves to bytes the planner meets, and the default never raises; errors are one short
line naming the field, the value and the accepted forms."""

import re

import pytest
import torch
from torch import nn

import hbp
from hbp import Budget, BudgetError, ConfigError
from hbp.allocator import allocator_peak
from hbp.planner.budget import FIT_MARGIN, BudgetKind, available_bytes
from tests.models.real import llama, pegasus

NAIVE, LEAST = 1000, 400


@pytest.mark.parametrize(
    ("given", "kind", "resolved"),
    [
        (0.5, BudgetKind.FRACTION, 500),
        (1.0, BudgetKind.FRACTION, 1000),
        ("50%act", BudgetKind.ACTIVATIONS, 700),  # least + half of (naive - least)
        ("0%act", BudgetKind.ACTIVATIONS, 400),
        (Budget.activations(0.25), BudgetKind.ACTIVATIONS, 550),
        (600, BudgetKind.BYTES, 600),
        ("10GiB", BudgetKind.BYTES, 1000),  # above the plain step: the plain step
        ("0.5KiB", BudgetKind.BYTES, 512),
        ("min", BudgetKind.MIN, "min"),
    ],
)
def test_every_form_resolves(given, kind, resolved):
    budget = Budget.parse(given)
    assert budget.kind is kind
    assert budget.resolve(NAIVE, lambda: LEAST) == resolved


def test_fit_is_the_available_memory_less_the_margin():
    big = 2**50
    expected = int(available_bytes(torch.device("cpu")) * (1 - FIT_MARGIN))
    assert abs(Budget.parse("fit").resolve(big, lambda: 0) - expected) < 0.05 * expected
    assert Budget.parse("fit").resolve(NAIVE, lambda: 0) == NAIVE  # it fits: the plain step


@pytest.mark.parametrize(
    "bad", [0, -5, 1.5, 0.0, float("nan"), True, None, "", "abc", "5 parsecs", "150%act", [1]]
)
def test_errors_are_one_short_line_naming_field_value_and_forms(bad):
    with pytest.raises(ConfigError) as info:
        Budget.parse(bad)
    message = str(info.value)
    assert "\n" not in message and len(message) <= 160, message
    assert message.startswith(f"budget={bad!r}")
    for form in ("(0, 1]", "%act", "64MiB", "'min'", "'fit'"):
        assert form in message
    with pytest.raises(ConfigError):
        hbp.HCModule(nn.Linear(2, 2), budget=bad)


def _llama_step():
    torch.manual_seed(0)
    model, _, kwargs = llama()
    return model.train(), kwargs


def _measured(module, kwargs) -> int:
    module(**kwargs).loss.backward()  # plans outside the measurement (workspace measured)
    module.zero_grad(set_to_none=True)
    return allocator_peak(lambda: module(**kwargs).loss.backward())[1]


def test_the_default_budget_never_raises_and_holds():
    """A Llama whose parameter gradients make a fraction of the naive peak infeasible: the
    default ("50%act") plans, between the least peak and the naive one, and the allocator's
    peak keeps it."""
    model, kwargs = _llama_step()
    hc = hbp.HCModule(model)
    measured = _measured(hc, kwargs)
    plan = hc.plan
    assert hc.budget == hbp.integrations.torch.DEFAULT_BUDGET
    assert plan.predicted_peak_bytes <= plan.budget_bytes <= plan.naive_peak_bytes
    assert measured <= 1.05 * plan.budget_bytes, (measured, plan.budget_bytes)


def test_min_is_what_the_allocator_measures_and_bytes_between_the_two_minima_plan():
    """ "min" is the allocator's peak of the step as the caller trains (`.loss.backward()`)
    within 3%; a byte budget above that least peak but below the least with the logits kept
    plans (no flag), and one at or above the naive peak plans the plain step."""
    model, kwargs = _llama_step()
    hc = hbp.HCModule(model, budget="min")
    measured = _measured(hc, kwargs)
    least = hc.plan.predicted_peak_bytes
    assert abs(measured - least) <= 0.03 * measured, (measured, least)
    kept = hbp.HCModule(model, budget="min", keeps_outputs=True)
    kept.prepare(**kwargs)
    assert kept.plan.predicted_peak_bytes > least
    between = (least + kept.plan.predicted_peak_bytes) // 2
    hc = hbp.HCModule(model, budget=between)
    assert _measured(hc, kwargs) <= 1.05 * between
    naive = hc.plan.naive_peak_bytes
    plain = hbp.HCModule(model, budget=naive + 1)
    _measured(plain, kwargs)
    assert not any(s.recompute for s in plain.plan.segments) and not plain.plan.schedule
    with pytest.raises(BudgetError, match="smallest feasible budget"):
        hbp.HCModule(model, budget=least // 2).prepare(**kwargs)


def test_min_and_a_budget_errors_minimum_agree_where_checkpoints_keep_generator_states():
    """With dropout a least peak is its plan's simulated peak (NOTE [ Simulated least peaks ]
    in hbp.planner.dp.least_peak): "min", `least_peak` and a BudgetError's minimum are one
    number, and a budget of it plans."""
    model, args, kwargs = pegasus()
    model.train()
    hc = hbp.HCModule(model, budget="min")
    hc(*args, **kwargs).loss.backward()
    graph = hc.captured.graph
    least = hbp.planner.least_peak(graph)
    assert hc.plan.budget_bytes == least >= hc.plan.predicted_peak_bytes
    with pytest.raises(BudgetError) as err:
        hbp.planner.plan(graph, least - 1)
    assert err.value.minimum == least


def test_a_fractions_budget_error_names_the_least_fraction_that_plans():
    """A fraction below the least peak: the error says the least fraction (two decimals) of
    the plain step's peak that plans, which does, while one hundredth less does not; the
    planner's own error says it too."""
    from hbp.graph import synthetic
    from hbp.planner import plan

    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4)]
    )
    x = torch.randn(256, 64)
    with pytest.raises(BudgetError) as raised:
        hbp.HCModule(model, budget=0.05).prepare(x)
    found = re.search(r"budget=(\d\.\d\d) or more plans", str(raised.value))
    assert found, str(raised.value)
    least = float(found.group(1))
    hbp.HCModule(model, budget=least).prepare(x)
    with pytest.raises(BudgetError):
        hbp.HCModule(model, budget=round(least - 0.01, 2)).prepare(x)
    with pytest.raises(BudgetError, match=r"budget=0\.\d\d or more plans"):
        plan(synthetic.residual_net(4), Budget.parse("0.05"))


def test_a_module_level_plans_budget_error_says_the_least_fraction_and_the_way_out():
    """A model no op-level tracer captures (a Python branch on data): its module-level plan's
    BudgetError for a fraction names the least fraction that plans and the budgets that
    always do, as an op-level one does."""
    from tests.models.traits import DataDependentMLP

    torch.manual_seed(0)
    model, x = DataDependentMLP(), torch.randn(256, 64)
    with pytest.warns(hbp.CaptureWarning), pytest.raises(BudgetError) as raised:
        hbp.HCModule(model, budget=0.02).prepare(x)
    message = str(raised.value)
    assert "module-level plan" in message and "'50%act', the default" in message
    assert re.search(r"budget=\d\.\d\d or more plans", message), message


def test_a_least_fraction_prints_the_plain_peak_rounded_as_the_minimum_is():
    """A minimum equal to the plain step's peak (parameter gradients alone) read "0.66 MiB"
    rounded up and the plain peak "0.65 MiB": a least peak above the plain step's."""
    from hbp.errors import in_mib
    from hbp.planner.budget import least_fraction

    nbytes = 683284  # 0.6516 MiB
    said = least_fraction(nbytes, nbytes)
    assert in_mib(nbytes, up=True) == "0.66"
    assert "plain step's peak (0.66 MiB)" in said and "budget=1.00 or more" in said
