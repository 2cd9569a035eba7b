"""Memory budgets: `Budget`, the one type every entry point (HCModule, `hbp.enable`,
`hbp.estimate`, mode=tiny) parses a user's budget into, once, where it is given.

| form                             | example                     | the step's peak is at most                    |
|----------------------------------|-----------------------------|-----------------------------------------------|
| float in (0, 1]                  | `0.5`                       | that fraction of the plain step's peak        |
| `"N%act"`, `Budget.activations`  | `"50%act"`                  | the least peak + N% of what checkpointing can |
|                                  |                             | save (naive - least): 0% = "min", 100% = plain |
| int, or a size string            | `2**30`, `"64MiB"`, `"1GB"` | those bytes (at or above the plain step's     |
|                                  |                             | peak: the plain step, nothing recomputed)      |
| `"min"`                          |                             | the least peak a plan reaches                 |
| `"fit"`                          |                             | free memory (CUDA: the device's; CPU: the      |
|                                  |                             | machine's available) less `FIT_MARGIN`        |

Every form but bytes below the least peak always has a plan (a byte budget that is too small
raises `hbp.BudgetError` with `.minimum`). The peak is the allocator's, above the level before
the step: activations, saved tensors, activation and parameter gradients, kernel workspace;
not the parameters, the inputs or the optimizer state.

`parse_budget(budget, naive_peak_bytes)` is the planner's own parser (fractions, bytes, sizes).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from hbp.errors import ConfigError, in_mib

__all__ = [
    "ACCEPTED",
    "FIT_MARGIN",
    "REACHABLE_BUDGETS",
    "Budget",
    "BudgetKind",
    "least_fraction",
    "parse_budget",
]

#: The accepted forms, as error messages name them.
ACCEPTED = "a fraction in (0, 1], 'N%act', bytes (an int or '64MiB'), 'min' or 'fit'"

#: What a BudgetError of a fraction or a byte budget adds: the budgets that always plan.
REACHABLE_BUDGETS = (
    "budget='min' plans for the least peak, and a share of what checkpointing saves "
    "('50%act', the default) is always within reach"
)

#: "fit" leaves this fraction of the free memory to everything else.
FIT_MARGIN = 0.1

UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_ACTIVATIONS = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*act(?:ivations)?\s*$", re.IGNORECASE)


class BudgetKind(Enum):
    """What a `Budget`'s value is."""

    FRACTION = "fraction"  # of the plain step's peak
    ACTIVATIONS = "activations"  # of what checkpointing can save, above the least peak
    BYTES = "bytes"
    MIN = "min"
    FIT = "fit"


@dataclass(frozen=True)
class Budget:
    """A memory budget for one training step (the forms: this module's table).

    `Budget.parse(x)` takes any accepted form (a `Budget` too) and raises `ConfigError` for
    anything else; `resolve` turns it into bytes once the step's figures are known."""

    kind: BudgetKind
    value: float | int = 0  # the fraction, or the bytes; 0 for "min" and "fit"
    given: object = None  # as the caller wrote it (shown in messages)

    @classmethod
    def parse(cls, budget) -> Budget:
        if isinstance(budget, Budget):
            return budget
        if isinstance(budget, str):
            text = budget.strip().lower()
            if text in ("min", "fit"):
                return cls(BudgetKind(text), 0, budget)
            m = _ACTIVATIONS.match(text)
            if m:
                return cls.activations(float(m.group(1)) / 100, given=budget)
        value = _to_bytes_or_fraction(budget)
        if isinstance(value, float):
            return cls(BudgetKind.FRACTION, value, budget)
        return cls(BudgetKind.BYTES, value, budget)

    @classmethod
    def activations(cls, fraction: float, given: object = None) -> Budget:
        """The least peak plus `fraction` (in [0, 1]) of what checkpointing can save: the
        quantity of torch.compile's `activation_memory_budget` (0: recompute all it can,
        1: the plain step)."""
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise ConfigError("budget", fraction if given is None else given, ACCEPTED)
        if math.isnan(fraction) or not 0 <= fraction <= 1:
            raise ConfigError("budget", fraction if given is None else given, ACCEPTED)
        return cls(BudgetKind.ACTIVATIONS, float(fraction), given or f"{fraction:.0%}act")

    @property
    def is_min(self) -> bool:
        return self.kind is BudgetKind.MIN

    def way_out(self, minimum: int = 0, naive_peak_bytes: int = 0) -> str | None:
        """What a `BudgetError` of this budget adds: the budgets that always plan, for a
        caller's number (a fraction, bytes), and for a fraction, with the error's `minimum`
        and the `naive_peak_bytes` it is a fraction of, the least fraction that plans; None
        for the forms that name their own."""
        if self.kind not in (BudgetKind.FRACTION, BudgetKind.BYTES):
            return None
        if self.kind is BudgetKind.FRACTION and minimum > 0 and naive_peak_bytes > 0:
            return f"{least_fraction(minimum, naive_peak_bytes)}; {REACHABLE_BUDGETS}"
        return REACHABLE_BUDGETS

    def resolve(
        self, naive_peak_bytes: int, least_peak: Callable[[], int], device=None
    ) -> int | str:
        """The planner's target: "min", or bytes at most `naive_peak_bytes` (a budget at or
        above the plain step's peak is met by the plain step). `least_peak()` gives the least
        peak a plan reaches (called only for activation fractions); `device`: where the step
        runs (for "fit")."""
        naive = int(naive_peak_bytes)
        if self.kind is BudgetKind.MIN:
            return "min"
        if self.kind is BudgetKind.FRACTION:
            return max(1, int(math.floor(self.value * naive)))
        if self.kind is BudgetKind.ACTIVATIONS:
            if self.value >= 1:
                return naive
            least = int(least_peak())
            return min(naive, least + int(math.floor(self.value * max(0, naive - least))))
        if self.kind is BudgetKind.FIT:
            return min(naive, int(available_bytes(device) * (1 - FIT_MARGIN)))
        return min(naive, int(self.value))

    def __str__(self) -> str:
        return str(self.given) if self.given is not None else f"{self.kind.value}:{self.value}"


def available_bytes(device=None) -> int:
    """Memory a step can still allocate: CUDA's free device memory, else the machine's
    available memory (psutil when installed, else `os.sysconf`)."""
    import torch

    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def least_fraction(minimum: int, naive_peak_bytes: int) -> str:
    """The least fraction of the plain step's peak, to two decimals, at or above `minimum`
    bytes, as a BudgetError of a fraction says it."""
    least = math.ceil(minimum / naive_peak_bytes * 100 - 1e-9) / 100
    return (
        f"as a fraction of the plain step's peak ({in_mib(naive_peak_bytes, up=True)} MiB), "
        f"budget={least:.2f} or more plans"
    )


def parse_budget(budget, naive_peak_bytes: int) -> int:
    """The budget in bytes, for the planner's entry points (`hbp.planner.plan`).

    Args:
        budget: float in (0, 1] = fraction of `naive_peak_bytes`; int = bytes; str = a size
            with a unit ("64MiB", "1.5GiB", "500MB", "2e6B"; a bare number string is a
            fraction if it has a decimal point and is at most 1, else a whole number of bytes).
        naive_peak_bytes: the simulated peak of plain autograd for this step.

    Raises:
        ConfigError: field "budget", for bools, non-positive or NaN values, fractions above
            1, byte counts above the naive peak (the planner plans below it; HCModule and
            `hbp.enable` accept them as the plain step), and strings that are not sizes.
    """
    value = _to_bytes_or_fraction(budget)
    if isinstance(value, float):
        value = int(math.floor(value * naive_peak_bytes))
    if value <= 0 or value > naive_peak_bytes:
        raise ConfigError(
            "budget",
            budget,
            f"a fraction in (0, 1] or bytes (an int or '64MiB') in [1, {naive_peak_bytes}]",
        )
    return value


def _to_bytes_or_fraction(budget) -> int | float:
    """A fraction in (0, 1] (float) or a positive number of bytes (int)."""
    if isinstance(budget, bool) or budget is None:
        raise ConfigError("budget", budget, ACCEPTED)
    if isinstance(budget, Budget) and budget.kind in (BudgetKind.FRACTION, BudgetKind.BYTES):
        return budget.value
    if isinstance(budget, str):
        m = _SIZE.match(budget)
        if not m:
            raise ConfigError("budget", budget, ACCEPTED)
        number, unit = float(m.group(1)), m.group(2).lower()
        if not unit:  # a bare number: a fraction if it is at most 1 with a point, else bytes
            if "." in m.group(1) and 0 < number <= 1:
                return number
            if number != int(number) or number <= 0:
                raise ConfigError("budget", budget, ACCEPTED)
            return int(number)
        if unit not in UNITS:
            raise ConfigError("budget", budget, ACCEPTED)
        value = int(math.floor(number * UNITS[unit]))
        if value <= 0:
            raise ConfigError("budget", budget, ACCEPTED)
        return value
    if isinstance(budget, int) or (hasattr(budget, "__index__") and not isinstance(budget, float)):
        if int(budget) <= 0:
            raise ConfigError("budget", budget, ACCEPTED)
        return int(budget)
    if isinstance(budget, float) or hasattr(budget, "__float__"):
        x = float(budget)
        if math.isnan(x) or not 0 < x <= 1:
            raise ConfigError("budget", budget, ACCEPTED + " (a float is a fraction)")
        return x
    raise ConfigError("budget", budget, ACCEPTED)
