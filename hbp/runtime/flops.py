"""FLOP counting (DESIGN.md "Metrics": `flops`) with `torch.utils.flop_counter`.

FLOPs are counted per aten op from shapes (a matmul of (m, k) @ (k, n) is 2·m·k·n), for
everything that runs inside the call: forward, the autograd engine's backward and any
recomputation. Ops without a formula (elementwise, reductions) count 0, as in
`FlopCounterMode`.
"""

from __future__ import annotations

import pandas as pd
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode

GLOBAL = "Global"  # FlopCounterMode's name for "the whole call"


def count_flops(fn, *args, **kwargs) -> tuple[object, int]:
    """Run `fn(*args, **kwargs)` under `FlopCounterMode`; return (result, total FLOPs)."""
    with FlopCounterMode(display=False) as counter:
        result = fn(*args, **kwargs)
    return result, int(counter.get_total_flops())


def flop_breakdown_frame(counter: FlopCounterMode) -> pd.DataFrame:
    """A finished counter's FLOPs as a long DataFrame with columns module, op, flops.

    `module` is the dotted module path FlopCounterMode assigns ("Global" is the whole call;
    a module's rows include its submodules' FLOPs); `op` is the aten op packet name."""
    rows = [
        (module, str(op), int(flops))
        for module, per_op in counter.get_flop_counts().items()
        for op, flops in per_op.items()
    ]
    return pd.DataFrame(rows, columns=["module", "op", "flops"])


def count_flops_breakdown(fn, *args, **kwargs) -> tuple[object, int, pd.DataFrame]:
    """Like `count_flops`, plus the per-module, per-op breakdown (`flop_breakdown_frame`)."""
    with FlopCounterMode(display=False) as counter:
        result = fn(*args, **kwargs)
    return result, int(counter.get_total_flops()), flop_breakdown_frame(counter)


class TotalFlopCounterMode(FlopCounterMode):
    """`FlopCounterMode` that counts only the total ("Global"), without module attribution.

    FlopCounterMode's ModuleTracker registers grad hooks on every module's outputs, also on
    outputs recomputed by torch.utils.checkpoint, and those hooks keep tensors alive until the
    garbage collector runs: stacked with a memory measurement it inflates the peak (by
    hundreds of KiB on an 8-block checkpointed MLP, and by a gc-dependent amount). This mode
    installs no hooks and holds no tensor, so it can share a step with `MemoryTracker` or
    the CUDA allocator statistics. Same totals as FlopCounterMode.
    """

    def __init__(self):
        super().__init__(display=False)

    def __enter__(self):
        self.flop_counts.clear()
        self.mode = _FlopCounterMode(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *args):
        exited = self.mode.__exit__(*args)
        self.mode = None
        return exited
