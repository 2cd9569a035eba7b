"""HCModule's errors: a budget no plan fits raises BudgetError with the smallest feasible
budget (in MiB and bytes); a malformed budget or option raises ConfigError at construction,
in one line naming the value and every accepted form; an int budget of 1 says it means one
byte; lazy modules must be initialised first."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.compare import compare, compare_with_plain, minimum_budget
from models.cases import CASE, images
from models.toy import D, DropoutMLP, Mixer
from torch import nn

import hbp
from hbp.errors import BudgetError, ConfigError


def test_a_budget_of_a_few_bytes_raises_budget_error_and_a_bad_string_config_error():
    model = DropoutMLP(depth=2)
    hc = hbp.HCModule(model, budget=1000)  # 1000 bytes
    with pytest.raises(BudgetError, match="MiB") as info:
        hc(torch.randn(32, D))
    assert info.value.minimum > 1000 and info.value.budget == 1000
    with pytest.raises(hbp.ConfigError, match="budget"):
        hbp.HCModule(model, budget="lots")


def test_a_budget_just_below_the_minimum_raises_budget_error_with_the_minimum():
    """4 KiB below the least peak: refused with that minimum, which itself fits ("min"
    resolves to it)."""
    case = CASE["tied_across"]
    minimum = minimum_budget(case)
    hc = hbp.HCModule(case.make_model(), budget=minimum - 4096)
    with pytest.raises(BudgetError, match="MiB") as info:
        hc(*case.make_inputs()[0])
    assert info.value.minimum == minimum and info.value.budget == minimum - 4096
    row = compare_with_plain(case, minimum)  # and the minimum itself fits
    assert row["peak"] <= 1.05 * minimum
    hc = hbp.HCModule(case.make_model(), budget="min")
    assert hc.prepare(*case.make_inputs()[0]).budget_bytes == minimum
    with pytest.raises(hbp.ConfigError, match="budget"):
        hbp.HCModule(case.make_model(), budget=1.5)


@pytest.mark.parametrize(
    "budget, words",
    [
        (-1, "budget=-1 is not accepted"),
        (0, "budget=0 is not accepted"),
        (0.0, "budget=0.0 is not accepted"),
        (2.0, "budget=2.0 is not accepted: expected a fraction in (0, 1]"),
        ("abc", "budget='abc' is not accepted"),
        ("-3MiB", "budget='-3MiB' is not accepted"),
        (None, "budget=None is not accepted"),
        (True, "budget=True is not accepted"),
    ],
)
def test_bad_budgets_fail_at_construction_with_the_accepted_values(budget, words):
    """One line naming the value and every accepted form."""
    accepted = r"a fraction in \(0, 1\], 'N%act', bytes \(an int or '64MiB'\), 'min' or 'fit'"
    with pytest.raises(ConfigError, match=accepted) as info:
        hbp.HCModule(Mixer(), budget=budget)
    assert words in str(info.value)
    assert "\n" not in str(info.value) and len(str(info.value)) <= 160


def test_budget_one_as_an_int_says_it_means_one_byte_and_bad_options_fail_early():
    hc = hbp.HCModule(Mixer(), budget=1, block_size=2)
    with pytest.raises(BudgetError, match=r"budget=1 is an int, i.e. 1 byte; .* budget=1\.0"):
        hc.prepare(images())
    with pytest.raises(ConfigError, match="block_size"):
        hbp.HCModule(Mixer(), block_size=0)
    with pytest.raises(ConfigError, match="planner"):
        hbp.HCModule(Mixer(), planner="greedy")


def test_lazy_modules_must_be_initialised_before_wrapping():
    model = nn.Sequential(nn.LazyLinear(64), nn.ReLU(), nn.LazyLinear(10))
    hc = hbp.HCModule(model, budget=0.6)
    x = torch.randn(128, 32)
    with pytest.raises(ConfigError, match=r"0.weight, 0.bias, 2.weight are lazy\): call it once"):
        hc(x)
    model(x)  # initialises the lazy parameters
    hc, plain, got = compare(lambda: model, (x,), budget=1.0)
    assert got.peak_bytes <= 1.05 * hc.plan.budget_bytes


def test_a_wrong_input_shape_raises_its_error_without_fake_tensor_tracebacks(caplog):
    """Fake tensors log each op whose meta function fails, with a traceback (~200 lines on
    stderr before the error); the capture reports failures itself."""
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    hbp.enable(model, budget="min")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            model(torch.randn(4, 5)).sum().backward()
    logged = [r for r in caplog.records if r.name == "torch._subclasses.fake_tensor"]
    assert not logged, logged[0].getMessage()
