"""The error contract (docs/architecture.md "Errors"): every bad input gets one clear message that names
the field and the accepted values."""

from __future__ import annotations

from hbp.units import MIB


class HBPError(Exception):
    """Base class of every error hbp raises on purpose."""


class ConfigError(HBPError, ValueError):
    """A configuration field has a value hbp does not accept.

    The message names the field, the value given and the accepted values.
    """

    def __init__(self, field: str, value, accepted: str):
        self.field = field
        self.value = value
        self.accepted = accepted
        super().__init__(f"{field}={value!r} is not accepted: expected {accepted}")


class BudgetError(HBPError, ValueError):
    """No plan fits the memory budget.

    Attributes:
        budget: the budget that was asked for, in bytes.
        minimum: the smallest budget, in bytes, for which a plan exists.
        detail: what the minimum is over (the plan space searched), or why.
    """

    def __init__(self, budget: int, minimum: int, detail: str = ""):
        self.budget = int(budget)
        self.minimum = int(minimum)
        self.detail = detail
        msg = (
            f"no plan fits a budget of {_mib(self.budget)} MiB ({self.budget} bytes); "
            f"the smallest feasible budget is {_mib(self.minimum)} MiB ({self.minimum} bytes)"
        )
        if detail:
            msg += f": {detail}"
        super().__init__(msg)


def _mib(nbytes: int) -> str:
    """MiB with two decimals, or six below 0.01 MiB (small models: never "0.00")."""
    return f"{nbytes / MIB:.2f}" if nbytes >= MIB / 100 else f"{nbytes / MIB:.6f}"


class CaptureWarning(UserWarning):
    """Op-level graph capture failed; hbp fell back to module-level cut points."""
