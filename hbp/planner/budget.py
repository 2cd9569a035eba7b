"""Memory budgets: the one parser every entry point (HCModule, mode=tiny, CLIs) uses."""

from __future__ import annotations

import math
import re

from hbp.errors import ConfigError

ACCEPTED = (
    "a fraction of the naive step peak in (0, 1] (e.g. 0.3), a positive int of bytes, "
    "or a size string like '64MiB', '1.5GiB', '500MB', '2e6B' (units B, KB, MB, GB, "
    "KiB, MiB, GiB; at most the naive peak), or 'min' (planner entry points: the least "
    "memory the planner can reach)"
)

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


def parse_budget(budget, naive_peak_bytes: int) -> int:
    """The budget in bytes.

    Args:
        budget: float in (0, 1] = fraction of `naive_peak_bytes`; int = bytes; str = a size
            with a unit ("64MiB", "1.5GiB", "500MB", "2e6B"; a bare number string is a
            fraction if it has a decimal point and is at most 1, else a whole number of bytes).
        naive_peak_bytes: the simulated peak of plain autograd for this step.

    Raises:
        ConfigError: field "budget", for bools, non-positive or NaN values, fractions above
            1, byte counts above the naive peak, and strings that are not sizes.
    """
    value = _to_bytes(budget, naive_peak_bytes)
    if value <= 0:
        raise ConfigError("budget", budget, ACCEPTED + "; it must be > 0 bytes")
    if value > naive_peak_bytes:
        raise ConfigError(
            "budget",
            budget,
            ACCEPTED + f"; {value} bytes is above the naive peak of {naive_peak_bytes} bytes",
        )
    return value


def _to_bytes(budget, naive_peak_bytes: int) -> int:
    if isinstance(budget, bool) or budget is None:
        raise ConfigError("budget", budget, ACCEPTED)
    if isinstance(budget, str):
        m = _SIZE.match(budget)
        if not m:
            raise ConfigError("budget", budget, ACCEPTED)
        number, unit = float(m.group(1)), m.group(2).lower()
        if not unit:  # a bare number: a fraction if it is at most 1 with a point, else bytes
            if "." in m.group(1) and number <= 1:
                return _to_bytes(number, naive_peak_bytes)
            if number != int(number):
                raise ConfigError("budget", budget, ACCEPTED)
            return int(number)
        if unit not in UNITS:
            raise ConfigError("budget", budget, ACCEPTED)
        return int(math.floor(number * UNITS[unit]))
    if isinstance(budget, int) or (hasattr(budget, "__index__") and not isinstance(budget, float)):
        return int(budget)
    if isinstance(budget, float) or hasattr(budget, "__float__"):
        x = float(budget)
        if math.isnan(x) or x <= 0:
            raise ConfigError("budget", budget, ACCEPTED)
        if x > 1:
            raise ConfigError("budget", budget, ACCEPTED + "; a float is a fraction, at most 1")
        return int(math.floor(x * naive_peak_bytes))
    raise ConfigError("budget", budget, ACCEPTED)
