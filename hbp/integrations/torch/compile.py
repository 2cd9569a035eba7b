"""torch.compile and HCModule: `HCModule(model, compile=True)` and `torch.compile(hc)` run the
plan with each segment compiled on its own (NOTE [ torch.compile of an HCModule ])."""

from __future__ import annotations

import torch

from hbp.errors import BudgetError, BudgetWarning
from hbp.graph.torch.capture import MODULE
from hbp.integrations.torch.warn import warn_at_caller
from hbp.planner.plan import any_pinned
from hbp.runtime.executors import make_executor
from hbp.units import MIB

# NOTE [ torch.compile of an HCModule ]
# Dynamo cannot trace the plan as one graph and keep its memory: the executor's nested
# non-reentrant checkpoints need a context_fn that swaps BatchNorm statistics and buffers
# during the recompute and switch autocast's cache off (Dynamo's checkpoint higher-order
# op accepts neither), and inside one graph AOTAutograd's partitioner and Inductor's
# scheduler, not the plan, would decide what is saved and when it is freed (nested
# recomputation flattened to one level). So torch.compile(hc) stops at HCModule's forward
# (a graph break, `torch.compiler.disable`), and the forward runs the plan with each
# segment compiled on its own (`hbp.runtime.executors.segments`, NOTE [ Compiled segments ]), as
# HCModule(..., compile=True) does. Code around the call (a compiled function that calls
# hc and computes the loss) is compiled as usual.
# Dynamo does not always trace forward: a frame entered under a dispatch mode (a FLOP
# counter, a memory tracker, the profiler) is skipped, and Dynamo then skips that code
# object for good, in every HCModule of the process. Such a forward runs as plain Python
# (`is_compiling()` is False) while Dynamo's frame callback stays set for the frames it
# calls, which would have Dynamo trace hbp's capture and planner one frame at a time
# (slow, and failing on numpy's stride tricks). So forward also takes the compiled path
# when that callback is set (`dynamo_callback_set`): the plan runs outside Dynamo with
# its segments compiled, as if forward had been traced.


def dynamo_callback_set() -> bool:
    """Whether this frame runs under a torch.compile'd caller that Dynamo does not trace it for
    (NOTE [ torch.compile of an HCModule ]): Dynamo's frame callback is set."""
    get = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", None)
    return get is not None and get() not in (None, False)


class CompiledSegments:
    """HCModule's compiled segments (a mixin of `HCModule`)."""

    @torch.compiler.disable(
        reason="HCModule runs its plan outside Dynamo and compiles each segment itself "
        "(torch.compile(hc) cannot use fullgraph=True; use HCModule(model, compile=True))"
    )
    def _forward_with_compiled_segments(self, *args, **kwargs):
        return self._step(args, kwargs, compiled_segments=True)

    def _executor(self, compiled, compiled_segments: bool = False):
        """The executor a call runs: with compiled segments if `compile` is set or the call
        is a torch.compile(hc) one (`compiled_segments`)."""
        if self.compile is False and not compiled_segments:
            return compiled.executor
        return self._segments_compiled(compiled)

    def _segments_compiled(self, compiled):
        """The executor of `compiled` with every segment run through torch.compile."""
        if compiled.segments_compiled is None:
            options = self.compile if isinstance(self.compile, dict) else {}
            if compiled.captured.granularity == MODULE:
                self._warn_once(
                    "compile-module-level",
                    "HCModule compiles the segments of op-level captures only; this module "
                    f"fell back to module level ({compiled.captured.fallback_reason}) and runs "
                    "eagerly",
                )
                compiled.segments_compiled = compiled.executor
            else:
                compiled.segments_compiled = make_executor(
                    compiled.captured,
                    compiled.plan,
                    compiled.root or self.module,
                    compile_options=options,
                )
        return compiled.segments_compiled

    def _plan_without_pins(self, compiled) -> None:
        """A signature planned for the eager executor, now called through torch.compile(hc):
        compiled segments run without pins (NOTE [ Running pinned values ]), so a plan with
        pins is made again without them."""
        compiled.pins = False
        plan = compiled.plan
        if compiled.captured.granularity == MODULE or not (
            any_pinned(plan.segments) or plan.schedule
        ):
            return
        budget = "min" if self._budget.is_min else compiled.plan.budget_bytes
        try:
            self._replan(compiled, budget)
        except BudgetError as err:  # only pins reached it
            self._replan(compiled, "min")
            warn_at_caller(
                f"HCModule: compiled segments run without pinned values, and without them no "
                f"plan fits {budget / MIB:.2f} MiB (the least is {err.minimum / MIB:.2f} MiB): "
                "planned for the least instead.",
                BudgetWarning,
            )
        compiled.measure_again()
