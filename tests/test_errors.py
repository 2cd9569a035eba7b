"""The error contract's messages (docs/architecture.md "Errors")."""

import pytest

from hbp.errors import BudgetError, ConfigError


def test_budget_error_states_budget_and_minimum_in_mib_and_bytes():
    err = BudgetError(10 * 2**20, 12 * 2**20)
    assert str(err) == (
        "no plan fits a budget of 10.00 MiB (10485760 bytes); "
        "the smallest feasible budget is 12.00 MiB (12582912 bytes)"
    )
    assert (err.budget, err.minimum) == (10 * 2**20, 12 * 2**20)


def test_budget_error_on_small_models_never_prints_zero_mib():
    err = BudgetError(1000, 5000, "activations need more")
    assert "0.00 MiB" not in str(err)
    assert "0.004769 MiB (5000 bytes)" in str(err) and str(err).endswith(": activations need more")


def test_budget_error_shows_a_budget_and_a_minimum_that_differ_as_different():
    err = BudgetError(5 * 2**20, 5 * 2**20 + 2568)
    assert "budget of 5.00 MiB (5242880 bytes)" in str(err)
    assert "smallest feasible budget is 5.01 MiB (5245448 bytes)" in str(err)
    err = BudgetError(5 * 2**20 - 1, 5 * 2**20)
    assert "budget of 4.999999 MiB" in str(err) and "budget is 5.000000 MiB" in str(err)


def test_the_minimum_in_mib_read_back_as_a_budget_plans():
    """The minimum is rounded up: a new user who copied "2.20 MiB" of a 2.203 MiB minimum got
    the error again."""
    from hbp.planner.budget import parse_budget

    for minimum in (2_310_136, 5_000, 12 * 2**20, 123_456_789):
        shown = str(BudgetError(1, minimum)).split("budget is ")[1].split(" MiB")[0]
        assert parse_budget(f"{shown}MiB", 10**12) >= minimum, shown


def test_config_error_names_field_value_and_accepted_values():
    err = ConfigError("mode.budget", "abc", "a fraction in (0, 1]")
    assert str(err) == "mode.budget='abc' is not accepted: expected a fraction in (0, 1]"
    assert isinstance(err, ValueError) and err.field == "mode.budget"
    with pytest.raises(ValueError, match="mode.budget"):
        raise err


TINY_BAD = [
    ({"name": "tiny", "budget": "abc"}, "mode.budget", "abc"),
    ({"name": "tiny", "budget": 1.5}, "mode.budget", 1.5),
    ({"name": "tiny", "planner": "foo"}, "mode.planner", "foo"),
]


@pytest.mark.parametrize(
    ("mode", "field", "value", "framework"),
    [
        *((*case, "torch") for case in TINY_BAD),
        *((*case, "jax") for case in TINY_BAD),
        ({"name": "compile_budget", "budget": "abc"}, "mode.budget", "abc", "torch"),
    ],
)
def test_a_bad_mode_value_is_named_by_its_config_key_before_anything_runs(
    mode, field, value, framework
):
    """Every mode's bad value is refused when the mode is built (the bench's `validate`, before
    a run directory or a model), under the key the user typed: tiny's budget was refused only
    once its run had started, and named `budget=`, where compile_budget's said `mode.budget=`."""
    from hbp.modes import build_mode

    with pytest.raises(ConfigError) as err:
        build_mode(mode, framework)
    assert (err.value.field, err.value.value) == (field, value)
