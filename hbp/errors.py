"""The error contract (docs/architecture.md "Errors"): every bad input gets one clear message that names
the field and the accepted values."""

from __future__ import annotations

import math

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
        budget_mib, minimum_mib = _mib_apart(self.budget, self.minimum)
        msg = (
            f"no plan fits a budget of {budget_mib} MiB ({self.budget} bytes); "
            f"the smallest feasible budget is {minimum_mib} MiB ({self.minimum} bytes)"
        )
        if detail:
            msg += f": {detail}"
        super().__init__(msg)

    def with_detail(self, more: str) -> BudgetError:
        """This error with `more` said after its detail (same budget and minimum)."""
        return BudgetError(self.budget, self.minimum, f"{self.detail}; {more}".lstrip("; "))


def in_mib(nbytes: int, decimals: int = 2, up: bool = False) -> str:
    """MiB with `decimals` decimals, or six below 0.01 MiB (small models: never "0.00");
    `up`: rounded up, so that the figure read back as a budget is at least `nbytes` (a
    minimum of 2.203 MiB reads "2.21", which plans, not "2.20", which does not)."""
    decimals = decimals if nbytes >= MIB / 100 else 6
    value = nbytes / MIB
    if up:
        value = math.ceil(value * 10**decimals - 1e-9) / 10**decimals
    return f"{value:.{decimals}f}"


def _mib_apart(a: int, b: int) -> tuple[str, str]:
    """`a` and `b` (a minimum, rounded up) in MiB with as many decimals (two to six) as tell
    them apart ("5.00 MiB" under "5.00 MiB" reads as no difference)."""
    for decimals in range(2, 7):
        shown = in_mib(a, decimals), in_mib(b, decimals, up=True)
        if shown[0] != shown[1] or a == b:
            return shown
    return shown


class CaptureError(HBPError, RuntimeError):
    """hbp could not capture a training step at all: every op-level tracer failed, and so did
    the module-level fallback. `HCModule` and `hbp.enable` then run the plain module for that
    input signature, with a `CaptureWarning`; `hc.prepare` and `hbp.estimate` raise it.

    Attributes:
        reasons: why each attempt failed, in order, one line each.
    """

    def __init__(self, module: str, reasons: list[str]):
        self.reasons = list(reasons)
        super().__init__(f"hbp could not capture {module}: {'; '.join(self.reasons)}")


class CaptureWarning(UserWarning):
    """Op-level graph capture failed; hbp fell back to module-level cut points (or, where
    that failed too, runs the plain module for that input signature)."""


class BudgetWarning(UserWarning):
    """A step was measured above its budget, or may be: what the plan did not see (a loss
    outside the module, outputs the caller keeps), a plan made under a running profiler. hbp
    says so once and plans again where it can; `warnings.filterwarnings("error",
    category=hbp.BudgetWarning)` turns each into an error."""


class CacheWarning(UserWarning):
    """A plan or a measured workspace could not be written to the cache directory (`plan_cache=`);
    the run goes on and plans or measures it again next time."""
