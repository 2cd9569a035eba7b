"""The allocator's peak of a call (`allocator_peak`): what the allocator holds at most while a
function runs, kernel workspace included (CUDA: `max_memory_allocated`; CPU: the allocator's own
events, recorded by the profiler), and the CPU profiler windows hbp's measurements keep open.

A foundation module (torch only, no hbp imports): the capture's scratch calibration
(`hbp.graph.torch.calibrate`), the runtime's step measurement and HCModule's closed loop all
measure with it.
"""

from __future__ import annotations

import gc
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import torch

try:  # private profiler API, used only by `allocator_peak`
    from torch._C._profiler import _EventType
except ImportError:  # pragma: no cover
    _EventType = None


def allocator_peak(fn, *args, device=None, **kwargs) -> tuple[object, int]:
    """Run `fn(*args, **kwargs)` and return (result, peak bytes): the most bytes the allocator
    holds at any moment of the call above what it held when the call started, with no dispatch
    mode active. This is `peak_bytes` of docs/architecture.md "Metrics": tensors, kernel
    workspace and scalars wrapped into tensors all count.

    CUDA (`device` a CUDA device): `torch.cuda.max_memory_allocated` minus the level before.
    CPU (default): the CPU allocator's own allocation events, recorded by the PyTorch profiler
    with memory profiling on (see NOTE [ CPU allocator peak ]). Exact; slower than a plain
    call (every op is recorded), so measure one step with it, never a timed one."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        with no_cycle_collection():  # NOTE [ No cycle collection inside a CUDA window ]
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            result = fn(*args, **kwargs)
            torch.cuda.synchronize(dev)
            return result, int(torch.cuda.max_memory_allocated(dev) - base)
    if _EventType is None:  # pragma: no cover
        raise RuntimeError("allocator_peak needs torch._C._profiler._EventType (torch >= 2.1)")
    close_open_windows()
    activities = [torch.profiler.ProfilerActivity.CPU]
    with quiet_profile(activities=activities, profile_memory=True) as prof:
        marker = torch.empty(_MARKER_BYTES, dtype=torch.uint8)
        marker_ptr = marker.data_ptr()
        del marker
        result = fn(*args, **kwargs)
    peak = profiler_peak_bytes(prof, marker_ptr)
    release_results(prof)
    return result, peak


def allocator_peaks(*fns, device=None) -> tuple[list, list[int]]:
    """Run `fns` in turn (each without arguments) in one measurement and return (their
    results, their peaks): the most bytes the allocator holds while each runs, above what it
    held when that one started. Unlike consecutive `allocator_peak` calls, a free of memory
    an earlier function of the call allocated counts (CPU: the profiler records no free of a
    block allocated before it started, NOTE [ CPU allocator peak ]): a backward that frees
    what its forward saved, measured after that forward."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    results: list = []
    if dev.type == "cuda":
        peaks = []
        with no_cycle_collection():  # NOTE [ No cycle collection inside a CUDA window ]
            for fn in fns:
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
                base = torch.cuda.memory_allocated(dev)
                results.append(fn())
                torch.cuda.synchronize(dev)
                peaks.append(int(torch.cuda.max_memory_allocated(dev) - base))
        return results, peaks
    if _EventType is None:  # pragma: no cover
        raise RuntimeError("allocator_peaks needs torch._C._profiler._EventType (torch >= 2.1)")
    close_open_windows()
    markers: list[int] = []
    with quiet_profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as p:
        for fn in fns:
            marker = torch.empty(_SPLIT_BYTES, dtype=torch.uint8)
            markers.append(marker.data_ptr())
            del marker
            results.append(fn())
    events = _cpu_events(p)
    release_results(p)
    starts: list[int] = []
    for ptr in markers:  # each marker's allocation, in order
        after = starts[-1] + 1 if starts else 0
        starts.append(
            next(
                k
                for k in range(after, len(events))
                if events[k][3] == ptr and events[k][1] == _SPLIT_BYTES
            )
        )
    fixed = _without_foreign_frees(events[starts[0] :])
    starts = [k - starts[0] for k in starts] + [len(fixed)]
    peaks = []
    for a, b in zip(starts[:-1], starts[1:]):
        level = fixed[a][2] - _SPLIT_BYTES
        peaks.append(max(0, int(max((e[2] for e in fixed[a + 1 : b]), default=level) - level)))
    return results, peaks


#: The size of the markers between the functions of one `allocator_peaks` call (an odd size
#: no op's tensor has).
_SPLIT_BYTES = 3


# NOTE [ No cycle collection inside a CUDA window ]
# On CUDA a window's peak is `max_memory_allocated` above the level at its start. Garbage
# from before the window (tensors held in reference cycles) changes that only where the
# cycle collector frees it inside the window: the level drops, and what the window allocates
# is then measured from below where it started. A full `gc.collect()` before each window
# ruled that out, but it walks every object the process tracks, and the scratch calibration
# opens one window per op signature: on a GPU machine most of a first step went to it
# (docs/results.md "CUDA"). Instead the collector is off inside the window and back on after
# it (as the caller had it): garbage from before stays allocated through the window, which
# leaves the level and the peak above it alone. The window's own frees are reference
# counting's, and run as ever.


@contextmanager
def no_cycle_collection() -> Iterator[None]:
    """The block runs with Python's cycle collector off; it is restored after as it was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# NOTE [ Quiet profiler windows ]
# Kineto (the profiler's C++ side) writes "USDT: ... profiler_start" and "... profiler_stop"
# to file descriptor 2 whenever a profiler starts or stops, below Python's sys.stderr, at
# every log level that keeps its errors (KINETO_LOG_LEVEL is read once per process). hbp
# opens a profiler for every CPU allocator measurement, so a bench run printed dozens of
# them. `quiet_profile` starts and stops the profiler with fd 2 pointed at a temporary file
# and writes back every line but Kineto's start/stop/stage lines: nothing else is lost, and
# the measured code itself runs with stderr untouched.
_KINETO_LINE = re.compile(r"^(USDT|STAGE):\S+ \S+ \d+:\d+ \w*ActivityProfiler\w*\.cpp:\d+\]")


@contextmanager
def without_kineto_lines() -> Iterator[None]:
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no fd 2 (an embedded interpreter): nothing to quieten
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines = capture.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not _KINETO_LINE.match(line))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


@contextmanager
def quiet_profile(**kwargs) -> Iterator[torch.profiler.profile]:
    """`torch.profiler.profile(**kwargs)` as a context manager whose start and stop print none
    of Kineto's lines (NOTE [ Quiet profiler windows ])."""
    prof = torch.profiler.profile(**kwargs)
    with without_kineto_lines():
        prof.start()
    try:
        yield prof
    finally:
        with without_kineto_lines():
            prof.stop()


def release_results(prof: torch.profiler.profile) -> None:
    """Free a stopped profiler's recorded results (every event of the measured calls) now: a
    profiler object sits in reference cycles, so they would otherwise stay in memory until a
    garbage collection."""
    inner = getattr(prof, "profiler", None)
    if inner is not None:
        inner.kineto_results = None


#: CPU profiler windows a measurement left open because it ends inside the autograd engine,
#: where a profiler cannot be stopped (HCModule's closed loop, `_StepPeakProbe`): CPU profilers
#: do not nest, so each is closed (its result kept) before another profiler starts. Held
#: strongly: a window whose module was dropped before its next call would otherwise leave its
#: profiler running for the rest of the process.
_OPEN_WINDOWS: set = set()


_OPTIMIZER_HOOK: list = []  # the handle of the optimizer hook that closes the windows


def hold_open(window) -> None:
    """Register a measurement window (an object with `stop()`) still recording. The next
    optimizer step closes it (a global step pre-hook): in a training loop that is right after
    the backward the window measured, before a profiler the caller may start next."""
    _OPEN_WINDOWS.add(window)
    if not _OPTIMIZER_HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        hook = register_optimizer_step_pre_hook(lambda *_: _close_outside_backward())
        _OPTIMIZER_HOOK.append(hook)


def _close_outside_backward() -> None:
    """`close_open_windows`, unless the optimizer steps inside the autograd engine (a step
    per parameter from `register_post_accumulate_grad_hook`), where a profiler cannot be
    stopped for good: the engine turned it back on when backward returned, and it recorded
    every event of the process from then on (a new-user trial: 397 MiB over 380 steps, and
    the caller's own profiler refused to start). The window is closed at the module's next
    call instead, or where its measurement is read."""
    if torch._C._current_graph_task_id() == -1:
        close_open_windows()


def close_open_windows() -> None:
    """Stop every registered window still recording (each keeps its result)."""
    for window in list(_OPEN_WINDOWS):
        window.stop()
        _OPEN_WINDOWS.discard(window)
    while _OPTIMIZER_HOOK:
        _OPTIMIZER_HOOK.pop().remove()


def foreign_profiler_running() -> bool:
    """Whether a profiler other than hbp's own measurement windows is running (those are
    closed first, each keeping its result): CPU allocator measurements cannot start then."""
    close_open_windows()
    return torch.autograd._profiler_enabled()


# NOTE [ CPU allocator peak ]
# With memory profiling on, PyTorch's CPU allocator reports every allocation and free to the
# profiler together with its running total of the bytes it allocated while profiling was on
# (`total_allocated`, kept under the allocator's lock, so it is exact and independent of how
# events are ordered or timestamped). The peak above the start is the largest running total
# minus the total right before the call. That start level is read from a marker: a 1-byte
# tensor allocated (and freed) first thing inside the profiler, whose event carries
# `total_allocated = start + 1`.
#
# Frees of tensors allocated before the window must not lower the level, and the running
# total alone gets them wrong: the allocator keeps a process-wide table of the sizes it saw
# allocated while some profiler was on, and an entry stays when its tensor is freed with no
# profiler on (a gradient allocated in one measured step, freed by `zero_grad` between steps).
# When the address is reused outside profiling and that tensor is freed inside a later window,
# the allocator finds the stale entry, reports a free of the stale size and lowers its total
# by it: a measured peak then depends on what the process measured before (in a test suite,
# the tests that ran earlier), and can even come out lower than the step's own tensors.
# So a free whose address was not allocated inside the window is "foreign": its size is added
# back to every later running total. (A free of an address with no entry is not reported at
# all.) Either way a step that frees tensors from before it is measured as if they were still
# alive: the measured peak is the step's own, whatever the process ran or left as garbage
# before (no `gc.collect()` before the window: with transformers imported it takes 0.5 s, and
# scratch calibration measures one window per op signature).
_MARKER_BYTES = 1


def profiler_peak_bytes(
    prof: torch.profiler.profile, marker_ptr: int | None = None, end_ptr: int | None = None
) -> int:
    """The most CPU-allocator bytes alive during a finished memory-profiling `prof`, above the
    level at its start (NOTE [ CPU allocator peak ]). `marker_ptr`: the address of a 1-byte
    tensor allocated first inside `prof` (see `allocator_peak`); without it the level at the
    start is taken from the earliest event. `end_ptr`: the address of a 1-byte tensor
    allocated where the measured window ends (later events are left out)."""
    if _EventType is None:  # pragma: no cover
        raise RuntimeError("profiler_peak_bytes needs torch._C._profiler._EventType (torch >= 2.1)")
    return _peak_of(_cpu_events(prof), marker_ptr, end_ptr)


def window_peak_bytes(prof: torch.profiler.profile, marker_ptr: int, end_ptr: int) -> int | None:
    """`profiler_peak_bytes` of a window whose start and end markers are both among `prof`'s
    events, else None: a profiler the caller started inside the window took its events (a
    torch.profiler.profile between the step and the read of its measurement: the window read
    0 bytes, and an over-budget step was taken for a measured one)."""
    events = _cpu_events(prof)
    ends = {(e[3], e[1]) for e in events}
    if (marker_ptr, _MARKER_BYTES) not in ends or (end_ptr, _MARKER_BYTES) not in ends:
        return None
    return _peak_of(events, marker_ptr, end_ptr)


def _peak_of(events: list[tuple], marker_ptr: int | None, end_ptr: int | None) -> int:
    """`profiler_peak_bytes` of the CPU allocator's `events` (`_cpu_events`)."""
    if not events:
        return 0
    marker = None
    if marker_ptr is not None:
        marker = next((e for e in events if e[3] == marker_ptr and e[1] == _MARKER_BYTES), None)
    first = marker if marker is not None else events[0]
    start_level = first[2] - first[1]
    if end_ptr is not None:
        # the last match: the allocator may have reused the address for a 1-byte tensor
        # (a bool scalar) before the end marker, which is held until the profiler stops
        # (NOTE [ The end marker stays allocated ] in hbp.integrations.torch.closed_loop)
        ends = [e for e in events if e[0] > first[0] and e[3] == end_ptr and e[1] == _MARKER_BYTES]
        end = ends[-1] if ends else None
        if end is not None:
            events = [e for e in events if e[0] < end[0]]
    events = _without_foreign_frees(events[events.index(first) :])
    if marker is not None:
        events = events[1:]  # the marker's own 1 byte is not the step's
    peak = max((e[2] for e in events), default=start_level)
    return max(0, int(peak - start_level))


def _cpu_events(prof: torch.profiler.profile) -> list[tuple]:
    """The CPU allocator's events of a finished memory-profiling `prof`: (time, size, running
    total, ptr), by time; at equal times a free first (an address is freed before reuse)."""
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            fields = event.typed[1]
            if fields.device.type == "cpu":
                events.append(
                    (event.start_time_ns, fields.alloc_size, fields.total_allocated, fields.ptr)
                )
        stack.extend(event.children)
    events.sort(key=lambda e: (e[0], e[1] > 0))
    return events


def _without_foreign_frees(events: list[tuple]) -> list[tuple]:
    """`events` (time, size, running total, ptr) in time order with each running total raised
    by the sizes of the foreign frees up to it (NOTE [ CPU allocator peak ])."""
    allocated: set[int] = set()
    foreign = 0
    fixed = []
    for time, size, total, ptr in events:
        if size > 0:
            allocated.add(ptr)
        elif ptr in allocated:
            allocated.discard(ptr)
        else:
            foreign -= size
        fixed.append((time, size, total + foreign, ptr))
    return fixed
