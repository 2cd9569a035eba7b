"""One step harness for every HCModule test: a training step of a module (plain, or wrapped
in HCModule) measured by the memory tracker and the FLOP counter, and the comparison of two
steps (outputs, parameter and input gradients, buffers such as BatchNorm statistics)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from hbp.runtime.flops import TotalFlopCounterMode
from hbp.runtime.tracker import MemoryTracker


@dataclasses.dataclass
class Case:
    name: str
    make_model: Callable[[], nn.Module]
    make_inputs: Callable[[], tuple[tuple, dict]]
    exact: bool = True  # bitwise equal outputs and gradients
    autocast: bool = False  # run under torch.autocast("cpu", dtype=torch.bfloat16)
    block_size: int = 1  # HCModule's block_size (coarser on ~100-node graphs: planning time)
    # The model computes its own loss (labels given) and is trained as users train it, the
    # outputs let go before backward; otherwise the loss is the sum of the outputs, which
    # frees them once computed, and the step holds them through backward as a loss that saves
    # its input does (the outputs backward starts from, which the first plan counts as held).
    own_loss: bool = False

    def autocast_context(self):
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast)

    def __str__(self) -> str:
        return self.name


def leaves(value) -> list[torch.Tensor]:
    """Tensor leaves of nested tuples, lists, dicts and dataclasses."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in leaves(v)]
    return [value] if isinstance(value, torch.Tensor) else []


@dataclasses.dataclass
class StepResult:
    outputs: list[torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    peak_bytes: int
    flops: int


def _off_the_books(t: torch.Tensor) -> tuple[np.ndarray, torch.dtype]:
    """A copy of `t` in numpy memory, which the tracker and torch's allocator do not see
    (16-bit floats travel as int16: numpy has no bfloat16)."""
    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return t.numpy().copy(), t.dtype


def _back_on_the_books(copy: tuple[np.ndarray, torch.dtype], dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(copy[0]).view(dtype)


def train_step(
    module, model, case, args, kwargs, seed=0, loss_fn=None, keep_outputs=False
) -> StepResult:
    """One training step of `module` (`model` or its wrapper) under the memory tracker and
    the FLOP counter: loss = `loss_fn(output)`, or the sum of every output that requires
    grad. `case` (or None) says whether the step runs under autocast.

    By default the step trains as users do (`model(**batch).loss.backward()`, Trainer): it
    holds only the loss through backward; the outputs are copied outside the measured memory
    for the comparison and let go before backward. `keep_outputs=True` holds them until
    backward ends (a caller that logs or reuses its logits)."""
    for p in model.parameters():
        p.grad = None
    for t in leaves((args, kwargs)):
        t.grad = None
    torch.manual_seed(seed)
    with TotalFlopCounterMode() as counter, MemoryTracker(record_timeline=False) as tracker:
        with case.autocast_context() if case is not None else contextlib.nullcontext():
            out = module(*args, **kwargs)
        if loss_fn is not None:
            loss = loss_fn(out)
        else:
            loss = sum(t.float().sum() for t in leaves(out) if t.requires_grad)
        if keep_outputs:
            outputs = [t.detach() for t in leaves(out)]
        else:
            copies = [(_off_the_books(t), t.dtype) for t in leaves(out)]
            del out
        loss.backward()
        del loss
    if not keep_outputs:
        outputs = [_back_on_the_books(c, dtype) for c, dtype in copies]
    grads = {n: p.grad for n, p in model.named_parameters()}
    inputs = [t for t in leaves((args, kwargs)) if t.requires_grad]
    grads.update({f"input{i}": t.grad for i, t in enumerate(inputs)})
    return StepResult(
        outputs,
        grads,
        {n: b.clone() for n, b in model.named_buffers()},
        tracker.peak_bytes,
        int(counter.get_total_flops()),
    )


def assert_close(a, b, exact, what):
    if exact:
        assert torch.equal(a, b), what
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=what)


def assert_same_step(expected: StepResult, got: StepResult, exact: bool = True):
    """Same outputs, parameter/input gradients and buffers (BatchNorm statistics)."""
    assert len(expected.outputs) == len(got.outputs)
    for i, (a, b) in enumerate(zip(expected.outputs, got.outputs)):
        assert_close(a, b, exact, f"output {i}")
    assert expected.grads.keys() == got.grads.keys()
    for name, a in expected.grads.items():
        b = got.grads[name]
        assert (a is None) == (b is None), name
        if a is not None:
            assert_close(a, b, exact, f"grad of {name}")
    for name, a in expected.buffers.items():
        assert torch.equal(a, got.buffers[name]), f"buffer {name}"
