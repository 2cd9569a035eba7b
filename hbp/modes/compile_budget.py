"""Mode "compile_budget": torch.compile with AOTAutograd's activation memory budget.

`torch.compile` traces forward + backward into one joint graph and its min-cut partitioner
decides which forward values the backward keeps and which it recomputes. With
`torch._functorch.config.activation_memory_budget = b` (b in [0, 1]) the partitioner keeps
at most about b times the activations that the default (speed-optimal) partition saves and
recomputes the cheapest rest: 1.0 is torch.compile's default, 0.0 recomputes all it can.
The partitioner reads the setting when the forward is compiled, i.e. on the first call, so
the mode applies the patch around the compiling step, not just around `torch.compile`.

Backends (`mode.backend`):
  inductor                     partitioner + Inductor kernel fusion (C++/OpenMP on CPU; the
                               first compile of a small model takes 20-30 s, then cached)
  aot_eager_decomp_partition   the same decompositions and partitioner, but the partitioned
                               graphs run op by op in eager PyTorch: separates the
                               partitioner's memory effect from fusion; compiles in seconds

`apply(workload, batch)` compiles: it runs one forward + backward of the loss on `batch`
under the budget patch and records its wall time as `compile_time_s` (the compile of both
graphs plus one execution, typically well under 1% of it). That step leaves no trace: the
parameters' `.grad`, the model's buffers (BatchNorm running statistics) and the RNG state are
restored afterwards. Before compiling, `torch._dynamo.reset()` drops compiled code of earlier
modes in this process, whose cache entries would otherwise be reused with their old budget.

Measuring memory: a TorchDispatchMode (`MemoryTracker`, the flop counter) that does not
declare `ignore_compile_internals()` makes Dynamo skip the frame: the model silently runs
eagerly (naive memory) and the skip sticks, so later calls stay eager too. Inductor also
allocates its buffers outside the dispatcher, invisible to any dispatch mode. So the module
`apply` returns refuses to run under such a mode, and under a `MemoryTracker` with the
inductor backend, with an error that says why; measure it with the allocator instead
(`hbp.allocator.allocator_peak` on CPU, CUDA allocator stats on GPU), which counts
everything the compiled code allocates. `aot_eager_decomp_partition` runs aten ops through
the dispatcher, so a tracker that ignores compile internals measures it exactly.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from hbp.errors import ConfigError
from hbp.runtime.tracker import MemoryTracker
from hbp.workloads.base import Batch, Workload

BACKENDS = ("inductor", "aot_eager_decomp_partition")


def _check_budget(budget) -> float:
    number = isinstance(budget, (int, float)) and not isinstance(budget, bool)
    if not number or not 0.0 <= budget <= 1.0:
        raise ConfigError("mode.budget", budget, "a number in [0, 1]")
    return float(budget)


class CompileBudgetMode:
    """torch.compile(model, backend=backend) with activation_memory_budget = budget.

    describe() -> {"name", "budget", "backend", "chunked_loss", "compile_time_s"};
    compile_time_s is None before `apply`."""

    measure_with = "allocator"  # the bench measures compiled code with the allocator

    name = "compile_budget"

    def __init__(self, budget: float = 0.5, backend: str = "inductor", chunked_loss: bool = False):
        self.budget = _check_budget(budget)
        if backend not in BACKENDS:
            raise ConfigError("mode.backend", backend, "one of " + ", ".join(BACKENDS))
        self.backend = backend
        self.chunked_loss = bool(chunked_loss)
        self.compile_time_s: float | None = None

    def budget_patch(self):
        """The functorch config patch under which forward graphs must be compiled."""
        return torch._functorch.config.patch(activation_memory_budget=self.budget)

    def apply(self, workload: Workload, batch: Batch) -> nn.Module:
        """Compile `workload.model` (same parameter objects) and trigger the compile with
        one side-effect-free training step on `batch`; return the compiled module."""
        torch._dynamo.reset()
        compiled = CompiledModel(torch.compile(workload.model, backend=self.backend), self.backend)
        with self.budget_patch():
            self.compile_time_s = _timed_silent_step(compiled, workload, batch)
        return compiled

    def describe(self) -> dict:
        return {
            "name": self.name,
            "budget": self.budget,
            "backend": self.backend,
            "chunked_loss": self.chunked_loss,
            "compile_time_s": self.compile_time_s,
        }


class CompiledModel(nn.Module):
    """The compiled model (`.compiled`, same parameter objects in the same order) behind a
    guard against dispatch modes that would make Dynamo fall back to eager (module doc)."""

    def __init__(self, compiled: nn.Module, backend: str):
        super().__init__()
        self.compiled = compiled
        self.backend = backend

    def forward(self, *args, **kwargs):
        for mode in _get_current_dispatch_mode_stack():
            if mode.is_infra_mode():
                continue
            kind = type(mode).__name__
            if not mode.ignore_compile_internals():
                raise RuntimeError(
                    f"compile_budget: {kind} is active and does not declare "
                    "ignore_compile_internals(), so torch.compile would run this model eagerly "
                    "(and keep it eager); measure compiled runs with the allocator "
                    "(hbp.allocator.allocator_peak) instead"
                )
            if self.backend == "inductor" and isinstance(mode, MemoryTracker):
                raise RuntimeError(
                    f"compile_budget: Inductor allocates its buffers outside the dispatcher, "
                    f"so {kind} would miss them; measure with the allocator "
                    "(hbp.allocator.allocator_peak) instead"
                )
        return self.compiled(*args, **kwargs)


def _timed_silent_step(module: nn.Module, workload: Workload, batch: Batch) -> float:
    """Wall seconds of one forward + backward of `workload.step_loss(module, batch)`, with the
    parameters' grads, the buffers and the RNG state put back as they were."""
    params = list(module.parameters())
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        for p in params:
            p.grad = None
        start = time.perf_counter()
        workload.step_loss(module, batch).backward()
        if devices:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    with torch.no_grad():
        for buf, saved in buffers:
            buf.copy_(saved)
    for p, grad in zip(params, grads):
        p.grad = grad
    return elapsed
