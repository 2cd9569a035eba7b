"""A run's mode as one label, the same in the printed summary, the report and the plots:
"checkpoint(block_size=2)", "tiny(budget=0.3, chunked_loss=True)".

The label shows the parameters the run was configured with that are set (not null, not
false) and that apply to its workload: a mode option that changes how the workload is built
(`WORKLOAD_OPTIONS`, e.g. `chunked_loss`) is shown only where the workload has that field
(its metrics row carries `workload_<option>`: gpt2 has an LM head, synthetic_dag has none),
with the value the workload was built with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["WORKLOAD_OPTIONS", "format_value", "mode_label"]

# Mode options that change how the workload is built (hbp.bench passes them only to
# workloads that have the field, and only where the workload config leaves it null).
WORKLOAD_OPTIONS = ("chunked_loss",)
# Parameters that never change what is measured.
HIDDEN = ("name", "plan_cache")
# The order parameters are shown in (then by name): the same label whatever order a table's
# columns came in.
ORDER = ("budget", "block_size", "segments", "policy", "backend", "planner")


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def format_value(value) -> str:
    """A parameter value as the label shows it: whole floats as ints (NaN turned ints into
    floats in a table), other floats with at most 4 significant digits."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) >= 1:
            return str(int(value))
        return f"{value:.4g}"
    return str(value)


def mode_label(mode: str, params: Mapping, facts: Mapping | None = None) -> str:
    """`mode` with its set parameters. `params`: the mode's config (config.mode, without or
    with `name`); `facts`: the run's fields (`workload_chunked_loss`, ...), which decide
    whether a WORKLOAD_OPTIONS parameter applies."""
    facts = facts or {}
    shown = []
    keys = sorted(params, key=lambda k: (ORDER.index(k) if k in ORDER else len(ORDER), k))
    for key in keys:
        value = params[key]
        if key in HIDDEN:
            continue
        if key in WORKLOAD_OPTIONS:
            built = facts.get(f"workload_{key}")
            if _missing(built):  # the workload has no such field: the option does not apply
                continue
            value = built
        if _missing(value) or value is False:
            continue
        shown.append(f"{key}={format_value(value)}")
    return f"{mode}({', '.join(shown)})" if shown else str(mode)
