"""FLOP counting (docs/architecture.md "Metrics": `flops`) with `torch.utils.flop_counter`.

FLOPs are counted per aten op from shapes (a matmul of (m, k) @ (k, n) is 2·m·k·n), for
everything that runs inside the call: forward, the autograd engine's backward and any
recomputation. Ops without a formula (elementwise, reductions) count 0, as in
`FlopCounterMode`.

The formulas and `TotalFlopCounterMode` live with the capture (`hbp.graph.torch.flops`), which
counts every node with them; every counter here uses the same ones, so predicted and measured
FLOPs follow one definition.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.utils.flop_counter import FlopCounterMode

from hbp.graph.torch.flops import FLOP_FORMULAS, TotalFlopCounterMode

__all__ = [
    "FLOP_FORMULAS",
    "TotalFlopCounterMode",
    "count_flops",
    "count_flops_breakdown",
    "flop_breakdown_frame",
    "flop_counter_mode",
]

GLOBAL = "Global"  # FlopCounterMode's name for "the whole call"

if TYPE_CHECKING:
    import pandas as pd


def flop_counter_mode(display: bool = False, depth: int = 2) -> FlopCounterMode:
    """A `FlopCounterMode` (per-module attribution) that also knows `FLOP_FORMULAS`."""
    return FlopCounterMode(display=display, depth=depth, custom_mapping=FLOP_FORMULAS)


def count_flops(fn, *args, **kwargs) -> tuple[object, int]:
    """Run `fn(*args, **kwargs)` under `TotalFlopCounterMode`; return (result, total FLOPs)."""
    with TotalFlopCounterMode() as counter:
        result = fn(*args, **kwargs)
    return result, int(counter.get_total_flops())


def flop_breakdown_frame(counter: FlopCounterMode) -> pd.DataFrame:
    """A finished counter's FLOPs as a long DataFrame with columns module, op, flops.

    `module` is the dotted module path FlopCounterMode assigns ("Global" is the whole call;
    a module's rows include its submodules' FLOPs); `op` is the aten op packet name."""
    import pandas as pd  # only for reports: keep `import hbp.runtime.flops` light

    rows = [
        (module, str(op), int(flops))
        for module, per_op in counter.get_flop_counts().items()
        for op, flops in per_op.items()
    ]
    return pd.DataFrame(rows, columns=["module", "op", "flops"])


def count_flops_breakdown(fn, *args, **kwargs) -> tuple[object, int, pd.DataFrame]:
    """Like `count_flops`, plus the per-module, per-op breakdown (`flop_breakdown_frame`)."""
    with flop_counter_mode() as counter:
        result = fn(*args, **kwargs)
    return result, int(counter.get_total_flops()), flop_breakdown_frame(counter)
