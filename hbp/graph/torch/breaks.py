"""Graph breaks: ops whose output shape or value depends on tensor data, captured at operator
level all the same (NOTE [ Data-dependent ops ]).

- `DATA_DEPENDENT`: the fake-tensor errors of such an op (`nonzero`, `masked_select`,
  `unique`, boolean-mask indexing, `_ctc_loss` with tensor lengths, `.item()`).
- `record_real_results`: run one fx node on real values, recording what each aten op returned
  (the node's `REAL_RESULTS` meta).
- `RealResults`: while active over fake tensors, an aten op whose fake kernel cannot know its
  output takes the recorded real one (shape, strides, dtype; a scalar's value).
- `other_branch_raises`, `guard`: a Python branch on tensor data whose other side raises (an
  input check) is taken as in the example and becomes a `guard` node.
"""

from __future__ import annotations

import dis
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

#: Fake-tensor errors of an op whose output depends on its inputs' data.
DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)

#: fx node meta: {aten op: [what each of its calls returned in the real run]}.
REAL_RESULTS = "hbp_real_results"


# NOTE [ Data-dependent ops ]
# Fake tensors have shapes but no data: `x[mask]`, `nonzero`, `masked_select`, `unique`, CTC's
# loss with tensor lengths, `.item()` cannot be run on them, and without a graph break the whole
# model went to module level. Capture has the example's real values, so such a node is run
# once for real (its inputs computed for real, with no autograd, from the example), and every
# aten op's result is recorded on the node; the fake run of the node (trace, profile) then
# takes, for an op whose fake kernel cannot know its output, the recorded one: a fake tensor of
# the real shape and strides (autograd above the fake mode records the op's backward as usual,
# so what backward saves is classified as for any node). The node stays one ordinary graph
# node: the executor runs it eagerly, the planner sees its measured sizes. Its sizes are the
# example's: a later step's data may select more or fewer elements, which the plan does not
# know of (the graph still runs correctly, as the plain forward would).
# A Python branch on tensor data whose other side only raises (an input check: `if
# labels.max() >= vocab: raise ValueError(...)`) takes the example's branch and records a
# `guard` node, which raises `GraphBreakGuardError` on a step whose data takes the other
# branch; HCModule then runs the plain forward for that step (NOTE [ A failed guard ] in
# hbp/integrations/torch/guards.py), so the caller sees the model's own error. Any other branch on data still fails the trace
# (the executors cannot switch to another graph mid-step; module level runs the forward).


class GraphBreakGuardError(RuntimeError):
    """A step's data took another Python branch than the captured example's (HCModule
    catches it and runs the plain forward for that step)."""


def guard(value: torch.Tensor, expected: bool) -> None:
    """The graph node of a Python branch on `value` taken as `expected` at capture."""
    if bool(value) != expected:
        raise GraphBreakGuardError(
            f"the forward branches on tensor data (`if <tensor>:`) and this step takes the "
            f"{'false' if expected else 'true'} branch, while the captured graph follows the "
            f"{'true' if expected else 'false'} one; call the module itself for this step"
        )


@dataclass(frozen=True)
class _TensorMeta:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


_JUMP_LIMIT = 64  # instructions of the other branch read before it counts as not raising


def other_branch_raises(frame: types.FrameType, taken: bool | None) -> bool:
    """Whether, in `frame` stopped at a conditional jump on a value that is `taken`, the
    branch not taken runs straight (no jump, no return) to a `raise`; for `taken=None`,
    whether either branch does."""
    if taken is None:
        return other_branch_raises(frame, True) or other_branch_raises(frame, False)
    instructions = list(dis.get_instructions(frame.f_code))
    at = next((i for i, ins in enumerate(instructions) if ins.offset == frame.f_lasti), None)
    if at is None or at + 1 >= len(instructions):
        return False
    jump = instructions[at]
    if not jump.opname.startswith("POP_JUMP") or not isinstance(jump.argval, int):
        return False
    jumps_when = "IF_TRUE" in jump.opname
    if "IF_TRUE" not in jump.opname and "IF_FALSE" not in jump.opname:
        return False
    start = jump.argval if (not taken) == jumps_when else instructions[at + 1].offset
    following = [ins for ins in instructions if ins.offset >= start][:_JUMP_LIMIT]
    for ins in following:
        if ins.opname == "RAISE_VARARGS":
            return True
        if "JUMP" in ins.opname or "RETURN" in ins.opname or ins.opname == "FOR_ITER":
            return False
    return False


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return _TensorMeta(tuple(x.shape), tuple(x.stride()), x.dtype, x.device)
    return x


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.results: dict[Any, list[Any]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.results.setdefault(func, []).append(tree_map(_meta, out))
        return out


def record_real_results(run, args: tuple, kwargs: dict) -> tuple[Any, dict[Any, list[Any]]]:
    """`run(*args, **kwargs)` on real values, with no autograd; its output and the recorded
    result of every aten op it called (for `RealResults`)."""
    with torch.no_grad(), _Recorder() as recorder:
        out = run(*args, **kwargs)
    return out, recorder.results


class RealResults(TorchDispatchMode):
    """Over a fake mode: an aten op that fails with a data-dependent error returns the
    recorded real result of its call (the n-th call of an op takes its n-th recorded one)."""

    def __init__(self, results: dict[Any, list[Any]]) -> None:
        super().__init__()
        self.results = results
        self.calls: dict[Any, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        n = self.calls[func] = self.calls.get(func, -1) + 1
        try:
            return func(*args, **(kwargs or {}))
        except DATA_DEPENDENT:
            recorded = self.results.get(func, [])
            if n >= len(recorded):
                raise
            return tree_map(_make, recorded[n])


def _make(meta: Any) -> Any:
    if isinstance(meta, _TensorMeta):
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=meta.device)
    return meta
