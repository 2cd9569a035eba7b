"""The closed loop: the first training step of each input signature is measured by the
allocator and, above the budget, planned again (NOTE [ The step around the module ] in
loss.py). It sees what the plan cannot: the caller's loss and its backward, kernel workspace,
compiled kernels' buffers."""

from __future__ import annotations

import atexit
import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from hbp.allocator import (
    close_open_windows,
    foreign_profiler_running,
    release_results,
    window_peak_bytes,
    without_kineto_lines,
)
from hbp.analysis.simulate import simulate
from hbp.errors import BudgetError, BudgetWarning
from hbp.graph.torch.capture import MODULE
from hbp.integrations.torch.outputs import grad_leaves
from hbp.integrations.torch.warn import warn_at_caller
from hbp.units import MIB

# a measurement still recording when the process exits: a CPU profiler left running then
# crashes the interpreter's shutdown
atexit.register(close_open_windows)

#: Times the closed loop plans again for one signature before it stops measuring.
MAX_REPLANS = 3

#: Calls of any HCModule in this process so far, and the HCModules whose last call's
#: backward has not ended (NOTE [ Other engines in the step ]).
_CALLS = [0]
_IN_FLIGHT: weakref.WeakSet = weakref.WeakSet()

# NOTE [ Other engines in the step ]
# A measurement spans a module's whole step, from its forward to the end of its backward:
# where two modules of one model are enabled one by one (a VAE's encoder and decoder), each
# one's measurement holds the other's activations too, and the over-budget warning blamed
# "the caller's loss" and advised `loss_fn=`, which cannot help (a new user's encoder measured
# 8.68 MiB against a budget of 4.33). A probe notes whether another HCModule's step was in
# flight when it started (called, its backward not ended: `_IN_FLIGHT`) or another HCModule
# was called within its window (`_CALLS`); the warning then says so, and that one engine
# around both is the way out.

#: A measured step this fraction above the budget counts as within it (allocator rounding).
TOLERANCE = 0.01

# NOTE [ No CPU measurement inside torch.compile(hc) ]
# Under torch.compile(hc) the step runs inside the compiled caller's frame, whose profiler
# range ("Torch-Compiled Region") opened before the measurement's profiler started. A CPU
# profiler session started there records results that crash the process when they are freed
# (a bad free in kineto's Result / MemoryTraceLogger destructors, seen after the closed loop
# planned such a step again). So on CPU the loop is off for torch.compile(hc) calls (a warning
# says so and points to `compile=True`, which compiles the same segments from outside any
# compiled region); CUDA's measurement needs no profiler and stays on.


class StepPeakProbe:
    """The allocator's peak from `__init__` to `end()`, above the level at `__init__`.

    CUDA: max_memory_allocated, read in `end()`. CPU: a profiler with memory events
    (`hbp.allocator.profiler_peak_bytes`); `end()` runs inside the autograd engine (a
    queued callback), where a profiler cannot be stopped for good (the engine restores the
    thread's profiler state when backward returns), so it marks the end with a 1-byte
    allocation and `stop()`, called at the module's next call or when
    `HCModule.measured_peak_bytes` is read, stops the profiler and reads the window
    (NOTE [ The end marker stays allocated ])."""

    def __init__(self, device: torch.device):
        self.device = device
        self.calls_at_start = _CALLS[0]  # NOTE [ Other engines in the step ]
        self.others_inside = False
        self._profiler = None
        self._peak: int | None = None
        self._end_ptr: int | None = None
        self._end_marker: torch.Tensor | None = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self._base = torch.cuda.memory_allocated(device)
            return
        from hbp.allocator import close_open_windows, hold_open

        close_open_windows()  # another module's measurement still recording: CPU profilers
        self._profiler = torch.profiler.profile(  # do not nest
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )
        with without_kineto_lines():  # NOTE [ Quiet profiler windows ]
            self._profiler.start()
        hold_open(self)
        marker = torch.empty(1, dtype=torch.uint8)
        self._marker_ptr = marker.data_ptr()
        del marker

    def end(self) -> None:
        self.others_inside = self.others_inside or _CALLS[0] > self.calls_at_start
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._peak = int(torch.cuda.max_memory_allocated(self.device) - self._base)
        elif self._end_ptr is None:
            # NOTE [ The end marker stays allocated ]
            self._end_marker = torch.empty(1, dtype=torch.uint8)
            self._end_ptr = self._end_marker.data_ptr()

    @property
    def ended(self) -> bool:
        """Whether the step's backward has ended."""
        return self._peak is not None or self._end_ptr is not None

    def stop(self) -> int | None:
        """The measured peak (None if the step's backward never ended); stops the profiler."""
        if self._profiler is None:
            return self._peak
        profiler, self._profiler = self._profiler, None
        with without_kineto_lines():
            profiler.stop()
        self._end_marker = None  # freed with the profiler off: not an event of the window
        if self._end_ptr is not None:  # None where the caller's profiler took the window
            self._peak = window_peak_bytes(profiler, self._marker_ptr, self._end_ptr)
        release_results(profiler)
        return self._peak

    def cancel(self) -> None:
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            with without_kineto_lines():
                profiler.stop()
            self._end_marker = None
            release_results(profiler)


# NOTE [ The end marker stays allocated ]
# The window's profiler keeps recording after the step's backward (it stops at the module's
# next call, or when the measurement is read), so whatever the caller runs in between is in
# its events: a plain reference step, the optimizer, logging. The step's end is marked by a
# 1-byte tensor, found again by its address. Freed at once, its address can be handed to a
# later 1-byte tensor of the caller's (a bool scalar) while the window still records, and that
# later event would be taken for the end: the peak would then be read up to the caller's
# code (a test measured its plain reference step, 1.73x the budget, this way, depending on
# what the process had allocated before). Held until the profiler has stopped, no other
# allocation can have that address after it, so the last event at its address is the marker.


# NOTE [ Calls before the previous call's backward ]
# Each call of a signature is planned and measured on its own: the closed loop's window starts
# at the call, above what the allocator already holds, so the activations an earlier call of
# the same step still keeps for its backward are below its baseline and no call measures over
# the budget. A step that calls the module twice before one backward (a siamese network)
# peaked at 1.5x its budget on every step without a word. A call that starts while the
# previous call's outputs' graph is alive and their backward has not begun warns once (a hook
# on each output that requires grad, until it has). The graph, not the outputs: a caller that
# pools each tower's output inside a helper (`enc(x).last_hidden_state.mean(1)`) drops the
# outputs and keeps their graph, and was not warned (a new user's trial: 1.6x the budget); a
# token kept in each output's autograd node (`grad_fn.metadata`) lives as long as the node.


class _GraphToken:
    """Kept in an output's autograd node (`grad_fn.metadata`): alive while that node is."""


def _graph_ref(t: torch.Tensor) -> weakref.ref:
    """A weak reference that lives as long as `t`'s autograd graph (NOTE [ Calls before the
    previous call's backward ]), not only `t`: a caller that pools the output (`out.mean(1)`)
    drops it and keeps its graph."""
    if t.grad_fn is None:
        return weakref.ref(t)
    token = _GraphToken()
    t.grad_fn.metadata["hbp_graph"] = token
    return weakref.ref(token)


def step_device(root: nn.Module | None, args, kwargs) -> torch.device:
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor):
            return t.device
    for p in root.parameters() if root is not None else ():
        return p.device
    return torch.device("cpu")


class ClosedLoop:
    """The closed loop (a mixin of `HCModule`)."""

    def _run_measured(self, compiled, executor, args, kwargs, in_compiled_region):
        _CALLS[0] += 1  # NOTE [ Other engines in the step ]
        _IN_FLIGHT.discard(self)
        device = step_device(compiled.root, args, kwargs)
        calibrate = self.calibrate is not False  # on by default, on CPU as on CUDA
        if device.type == "cpu" and in_compiled_region and calibrate:
            # NOTE [ No CPU measurement inside torch.compile(hc) ]
            # the loop is on unless calibrate=False: say once why it is off here
            self._warn_once(
                "compiled-region-cpu",
                "HCModule: a torch.compile(hc) (or torch.compile of an enabled model) step "
                "on CPU cannot be measured by the allocator (a profiler started inside the "
                "compiled caller's region corrupts its results), so the closed loop is off "
                "there; HCModule(model, budget, compile=True) (hbp.enable(model, budget, "
                "compile=True)) compiles the same segments and keeps the loop.",
            )
            calibrate = False
        if (
            compiled.settled
            or not (device.type == "cuda" or calibrate)
            or (device.type == "cpu" and foreign_profiler_running())  # cannot nest
        ):
            output = executor(*args, **kwargs)
            if "called-before-backward" not in self._warned:  # (said once: no hooks after)
                self._await_backward(grad_leaves(executor, output), self._landed)
            return output
        probe = StepPeakProbe(device)
        probe.others_inside = any(engine is not self for engine in _IN_FLIGHT)
        try:
            output = executor(*args, **kwargs)
        except BaseException:
            probe.cancel()
            raise
        leaves = grad_leaves(executor, output)
        if not leaves:
            probe.cancel()
            return output
        self._probe = (probe, compiled)
        self._await_backward(leaves, lambda: (probe.end(), self._landed()))
        return output

    def _landed(self) -> None:
        """This call's backward has ended (NOTE [ Other engines in the step ])."""
        _IN_FLIGHT.discard(self)

    def _await_backward(self, leaves: list[torch.Tensor], on_start=None) -> None:
        """Note when the backward from `leaves` (this call's outputs) starts; then run
        `on_start` after it, in the autograd engine (NOTE [ Calls before the previous call's
        backward ]: a later call that finds it not started warns)."""
        if not leaves:
            return
        if on_start is not None:
            _IN_FLIGHT.add(self)  # NOTE [ Other engines in the step ]
        started: list[bool] = []

        def on_grad(grad):
            if not started:  # the first output gradient: the rest of backward follows
                started.append(True)
                if on_start is not None:
                    torch.autograd.Variable._execution_engine.queue_callback(on_start)
            return grad

        for t in leaves:
            t.register_hook(on_grad)
        self._awaiting_backward = ([_graph_ref(t) for t in leaves], started)

    def _warn_if_called_before_backward(self) -> None:
        """NOTE [ Calls before the previous call's backward ]"""
        awaiting, self._awaiting_backward = self._awaiting_backward, None
        if awaiting is None:
            return
        refs, started = awaiting
        if started or not any(r() is not None for r in refs):
            return  # its backward ran, or its outputs' graph is gone
        self._warn_once(
            "called-before-backward",
            "HCModule: the module was called again before the backward of its previous call, "
            "whose outputs are still held (two towers of a contrastive loss, a model applied "
            "twice per step): the activations of both calls are live together, and the "
            "budget holds per call, so the step's peak can reach the sum of the calls' "
            "peaks. Give each call its share of the budget, or run the inputs as one batch.",
            BudgetWarning,
        )

    def _finish_ended_probe(self) -> None:
        """`_finish_probe` where the measured step's backward has ended (else the step goes
        on being measured)."""
        if self._probe is not None and self._probe[0].ended:
            self._finish_probe()

    def _finish_probe(self) -> None:
        """Read a measured step whose backward has ended (see `StepPeakProbe`); drop one
        whose backward never ran."""
        measured = self._stop_probe()
        if measured is not None:
            self._read_step(measured[0], measured)

    def _read_step(self, compiled, measured) -> None:
        """What the last step showed of `compiled`'s plan: the outputs the caller kept
        through its backward, then its measured peak (`measured`: (compiled, peak) or None)
        (NOTE [ A measured step read before the next call ])."""
        peak = measured[1] if measured is not None and measured[0] is compiled else None
        if peak is not None:  # NOTE [ The loss outside the module, at a new size ]
            rate = _loss_outside_per_output_byte(compiled, peak)
            if rate is not None:
                compiled.outside_per_output_byte = rate
        if peak is not None and compiled.outputs_seen is not None:
            # NOTE [ Kept outputs after unseen memory ]: the outputs' plan nets them out
            compiled.unseen_bytes = max(peak - compiled.plan.predicted_peak_bytes, 0)
        if self._outputs_observed(compiled) and peak is not None:
            compiled.last_measured_peak_bytes = peak  # planned again for them: measured anew
            return
        if measured is not None:
            self._step_measured(*measured)

    # NOTE [ A measured step read before the next call ]
    # A step's measurement is read with the outputs the caller kept through that step's
    # backward (NOTE [ Outputs the caller lets go ]), at the next call or where
    # `hc.measured_peak_bytes` is read between the steps, in one order: the outputs are
    # planned for, with what the measured peak held beyond them and the plan (NOTE [ Kept
    # outputs after unseen memory ]). The read between steps took the measurement alone
    # first: it blamed "memory the plan did not see", told the caller to raise the budget,
    # and planned below the budget for the kept outputs' bytes. The next call dropped the
    # measurement: memory beyond the outputs cost a second step over the budget.

    def _room_for_the_loss_outside(self, compiled) -> None:
        """Plan `compiled` again, below its budget, where the caller's loss outside the module,
        as measured steps of this module showed it, would take the end of its forward above
        the budget (NOTE [ The loss outside the module, at a new size ])."""
        rate = max((c.outside_per_output_byte for c in self._captures()), default=0.0)
        if not rate or self._budget.is_min or not loss_outside(compiled):
            return
        outside = int(rate * output_bytes(compiled))
        for _ in range(MAX_REPLANS):
            forward_end = simulate(compiled.captured.graph, compiled.plan).forward_end_bytes
            over = forward_end + outside - compiled.budget_bytes
            if over <= 0:
                return
            # below the plan's peak: a plan that is within a lower budget already does not
            # change (its forward end with it)
            target = min(compiled.plan.budget_bytes, compiled.plan.predicted_peak_bytes) - over
            if target <= 0:
                return
            try:
                self._replan(compiled, target)
            except BudgetError:
                return  # the closed loop measures the step, and says what it can do
            compiled.unseen_bytes = compiled.budget_bytes - target

    def _stop_probe(self):
        """(compiled, peak) of a measured step whose backward has ended, else None; the
        measurement is over either way."""
        if self._probe is None:
            return None
        (probe, compiled), self._probe = self._probe, None
        ended = probe.ended
        peak = probe.stop()
        compiled.others_inside = probe.others_inside
        if ended and peak is None:  # the window's events were taken (`window_peak_bytes`)
            self._warn_once(
                "profiler-took-window",
                "HCModule: a profiler started after a step's backward and before the optimizer "
                "step or the next call, while hbp's allocator measurement of that step still "
                "recorded; it took the measurement's events, and the step is measured again "
                "at its next call. Start profilers after optimizer.step().",
                BudgetWarning,
            )
        return None if peak is None else (compiled, peak)

    def _step_measured(self, compiled, peak: int) -> None:
        """A measured step peaked at `peak` bytes; above the budget, plan again for the
        budget less what the plan did not see (at most `MAX_REPLANS` times).

        What it did not see is the measured peak less the plan's predicted one, not the
        excess over the budget: a plan predicted below its budget, re-planned for the budget
        less the excess, may fit that target as it is and be chosen again (an MLP whose caller
        holds its output and an mse_loss: 1.042x its budget, then 1.042x again)."""
        compiled.measured_peak_bytes = compiled.last_measured_peak_bytes = peak
        compiled.measurements += 1
        excess = peak - compiled.budget_bytes
        if (
            excess <= TOLERANCE * compiled.budget_bytes
            or compiled.measurements > MAX_REPLANS
            or compiled.last_measurement
        ):
            compiled.settled = True
            return
        unseen = peak - compiled.plan.predicted_peak_bytes
        compiled.unseen_bytes = max(unseen, 0)  # NOTE [ Kept outputs after unseen memory ]
        target = min(compiled.budget_bytes - unseen, compiled.plan.budget_bytes - excess)
        loss_inside = loss_in_graph(compiled)
        advice = "raise the budget."
        if compiled.captured.granularity == MODULE:  # approximate: the CaptureWarning said why
            unseen_said = (
                "memory the module-level plan did not predict (the Python between its block "
                "calls, custom autograd Functions' own backward, kernel workspace) or the "
                "caller's loss outside the module. "
            )
            if not loss_inside:
                advice = (
                    "raise the budget (or pass loss_fn= where the loss is computed outside "
                    "the module)."
                )
        elif loss_inside:
            unseen_said = (
                "memory the plan did not see (what the caller allocates or keeps during the "
                "step, hooks, kernel workspace or compiled kernels' buffers). "
            )
        else:
            unseen_said = (
                "memory outside the module (the caller's loss and its backward), kernel "
                "workspace or compiled kernels' buffers the plan did not see. "
            )
            advice = "pass loss_fn= so that hbp plans the loss too, or raise the budget."
        if self.compile is not False:  # the plan is eager autograd's (NOTE [ The step around
            # the module ] in loss.py)
            unseen_said += (
                "With compiled segments, Inductor's kernels save and allocate otherwise than "
                "the eager autograd the plan models. "
            )
            advice = "compile=False keeps the budget, or raise the budget."
        if compiled.others_inside:  # NOTE [ Other engines in the step ]
            unseen_said += (
                "Another module run by hbp was called within this step (an encoder and a "
                "decoder enabled one by one): its memory counts here too; enable the module "
                "around them once instead. "
            )
            advice = "enable one module around them all, or raise the budget."
        message = (
            f"HCModule: the measured step peaked at {peak / MIB:.2f} MiB (allocator), "
            f"{excess / MIB:.2f} MiB above the budget of {compiled.budget_bytes / MIB:.2f} MiB: "
            + unseen_said
        )
        if target <= 0:  # what the plan did not see is the whole budget or more
            compiled.settled = True
            warn_at_caller(
                message + f"That is {unseen / MIB:.2f} MiB, no less than the budget: no plan "
                f"can meet it this way; {advice}",
                BudgetWarning,
            )
            return
        try:
            self._replan(compiled, target)
        except BudgetError as err:
            compiled.settled = True
            said = f"No plan fits {target / MIB:.2f} MiB (the least is {err.minimum / MIB:.2f} MiB)"
            if self._budget.is_min:  # NOTE [ The least plan where the budget cannot be met ]
                self._warn_once(
                    "min-unseen",
                    message + f'{said}: "min" is the least hbp plans, and what the plan '
                    f"did not see comes on top: the budget cannot be met this way; {advice}",
                    BudgetWarning,
                )
                return
            if err.minimum < compiled.plan.predicted_peak_bytes:
                self._replan(compiled, "min")
                compiled.measure_again(last=True)
                said += ": planned for the least, the nearest to the budget"
            warn_at_caller(
                message + f"{said}; the budget cannot be met this way; {advice}", BudgetWarning
            )
            return
        warn_at_caller(
            message + f"Planned again for {target / MIB:.2f} MiB; the next steps keep the budget "
            "(hc.measured_peak_bytes holds the measured figure).",
            BudgetWarning,
        )


# NOTE [ The least plan where the budget cannot be met ]
# A measured step above the budget is planned again for the budget less what its plan did
# not see; where no plan fits that, the step kept the plan that went over (a Qwen2 at 0.5
# with its loss outside: 1.092x the budget, where the least plan measured 1.002x). It now
# runs the least plan, the nearest to the budget, measured once more, and the warning says
# so. A "min" budget is that plan already: what the plan did not see (the caller's loss)
# comes on top of it at every shape, which is said once, not at each new shape with "raise
# the budget" (a new-user trial on an OPT: 1.24-1.31x at every shape).


#: An output of at most this many bytes that backward starts from is a loss (a scalar).
LOSS_BYTES = 16


def loss_in_graph(compiled) -> bool:
    """Whether backward starts only from scalars the captured step computes itself (a loss
    passed as `loss_fn=`, or a model's own loss from its labels): then the caller's loss is
    no part of what a measured step held above its plan, and `loss_fn=` is no advice."""
    sizes = _seed_bytes(compiled)
    return bool(sizes) and all(size <= LOSS_BYTES for size in sizes)


def _seed_bytes(compiled) -> list[int]:
    """The storage bytes of each output backward starts from (`value_bytes`)."""
    graph = compiled.captured.graph
    return [value_bytes(graph, s) for s in graph.backward_seeds()]


def value_bytes(graph, name: str) -> int:
    """Bytes of the storage of node `name`'s output: its own, or the value it is a view of
    (an output made by `.contiguous()` of a contiguous tensor is its input: 0 bytes of its
    own, which read as a scalar loss: an OPT's logits)."""
    node = graph.node(name)
    while node.alias_of is not None:
        node = graph.node(node.alias_of)
    return node.output_bytes


# NOTE [ The loss outside the module, at a new size ]
# The closed loop learns from a signature's first step what its plan did not see, and plans
# that signature again; each new signature learned it anew, over the budget on its own first
# step: a GPT-2 whose cross-entropy is computed outside the module went 1.31x over at one
# length and 1.32x at the next, each with a warning. A loss outside the module runs between
# the end of the forward and the start of the backward, on the outputs backward starts from
# (the logits), and its memory grows with them (a cross-entropy: its log-softmax, their
# gradient and the logits' gradient, 3.0x the logits at every length measured). So where a
# measured step peaked above its plan and backward starts from outputs none of which is a
# loss (`loss_outside`), that peak less what the plan holds at the end of the forward, per
# byte of those outputs, is kept with the capture. A new signature's plan (or a known one's
# new plan) whose forward ends within less than that rate times its own outputs' bytes of the
# budget is planned again, for the budget less the overshoot (up to `MAX_REPLANS` times):
# plans the closed loop would have made after an over-budget step, and none where the plan
# leaves the room. The loop still measures the step, and corrects a rate that did not hold;
# a plan for "min" is the least already.


def loss_outside(compiled) -> bool:
    """Whether the caller's loss is outside the module: backward starts from outputs, none of
    them a scalar (a model's own loss from its labels is one, and the caller's loss then)."""
    sizes = _seed_bytes(compiled)
    return bool(sizes) and all(size > LOSS_BYTES for size in sizes)


def output_bytes(compiled) -> int:
    """Bytes of the outputs backward starts from that are more than a loss (a scalar)."""
    return sum(size for size in _seed_bytes(compiled) if size > LOSS_BYTES)


def _loss_outside_per_output_byte(compiled, peak: int) -> float | None:
    """The memory a loss outside the module took in a step measured at `peak`, per byte of
    the outputs backward starts from; None where no loss is outside or the step peaked
    within its plan (the loss's memory is then not known: NOTE [ The loss outside the
    module, at a new size ])."""
    if not loss_outside(compiled):  # then every output it starts from has bytes
        return None
    if peak <= compiled.plan.predicted_peak_bytes + TOLERANCE * compiled.budget_bytes:
        return None
    forward_end = simulate(compiled.captured.graph, compiled.plan).forward_end_bytes
    return max(peak - forward_end, 0) / output_bytes(compiled)
