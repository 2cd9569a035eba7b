"""Memory measurement: the exact live-storage tracker (the allocator's peak: `hbp.allocator`).

docs/architecture.md "Metrics": `peak_bytes` is what the allocator holds (`allocator_peak`: CUDA's
`max_memory_allocated`, on CPU the allocator's own events); `tensor_peak_bytes` is what
`MemoryTracker` counts (live tensor storages), the attribution tool; the difference is kernel
scratch (`scratch_bytes`).

`MemoryTracker` is a `TorchDispatchMode`: every aten op that runs while it is active (forward,
the autograd engine's backward, checkpoint recomputation, optimizer steps) passes through it.
An op output whose storage is not one of the op's inputs' storages and is not already tracked
is new memory: its storage is charged at its `nbytes` and a weakref with a finalizer is put
on the `UntypedStorage` Python object. PyTorch preserves that Python object for as long as the
C++ storage lives, so the finalizer fires exactly when the storage is freed, however the last
reference goes away (a Python `del`, autograd releasing saved tensors, a view dying). This is
how `torch.distributed._tools.mem_tracker` tracks storages too.

Not new memory: views, in-place results, `out=` results, `detach`, `weight.t()` and any other
output that shares a storage with an input; a storage that is already tracked; storages
created before `__enter__` (they never become tracked, so they cost nothing when they appear
as outputs of in-place ops). A tracked storage that an op resizes (`resize_`, `out=` ops) is
re-charged at its new size.

Limits: memory an op allocates and frees inside its kernel (scratch space) is invisible, as
are scalars wrapped into tensors outside the dispatcher, `UntypedStorage.resize_` called
outside the dispatcher and growth of storages created before `__enter__`. Meta-device tensors
(no memory) and tensors without a storage (sparse, nested) are not counted.

An observer effect: while any dispatch mode is active, autograd treats every tensor as
"subclass-like" (`at::isTensorSubclassLike`), so the engine accumulates a gradient that
arrives twice out of place (`a + b`, where plain autograd does `a.add_(b)`), and a few
backward formulas (index, masked, max/min-with-indices) use their out-of-place variants. Live
bytes can then exceed plain execution for the one op that does it. On the models in
tests/test_tracker.py (MLPs, residual MLPs, a GPT-like stack) the peak equals the CPU
allocator's peak measured with no dispatch mode (`allocator_peak`) to the byte; convolutions,
attention and norms allocate kernel workspace on top, which only `allocator_peak` sees.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    import pandas as pd

FORWARD = "forward"
BACKWARD = "backward"

TIMELINE_COLUMNS = ("op_index", "live_bytes", "phase", "op")

_active_trackers: list[MemoryTracker] = []


def _storage(value) -> torch.UntypedStorage | None:
    """The untyped storage behind a tensor (or the storage itself); None where there is none."""
    if isinstance(value, torch.UntypedStorage):
        return value
    if not isinstance(value, torch.Tensor) or value.is_meta:
        return None
    try:
        return value.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, storage-less subclasses
        return None


def _leaves(values):
    """The leaves of an op's outputs or arguments; fast path for the common flat shapes."""
    if isinstance(values, torch.Tensor):
        return (values,)
    if isinstance(values, (tuple, list)) and all(
        isinstance(v, torch.Tensor) or not isinstance(v, (tuple, list, dict)) for v in values
    ):
        return values
    return tree_leaves(values)


def _storage_keys(args, kwargs) -> set[int]:
    """Identities (C++ StorageImpl addresses) of the storages behind the op's inputs."""
    keys = set()
    for leaf in (*_leaves(args), *tree_leaves(kwargs)) if kwargs else _leaves(args):
        st = _storage(leaf)
        if st is not None:
            keys.add(st._cdata)
    return keys


class MemoryTracker(TorchDispatchMode):
    """Counts the bytes of tensor storages created and freed while active.

    Usage::

        with MemoryTracker() as mt:
            loss = model(x).sum()
            loss.backward()
        mt.peak_bytes          # most bytes alive at once, above the level at __enter__
        mt.timeline_frame()    # one row per op: op_index, live_bytes, phase, op

    Attributes:
        current_bytes: bytes of storages created inside the `with` block and still alive
            (updated until `__exit__`, then frozen).
        peak_bytes: the maximum of `current_bytes` over the block, in bytes. Only storages
            created inside count: tensors alive before `__enter__` are the baseline 0.
        peak_by_phase: phase name -> the maximum of `current_bytes` at the ops of that phase.
        timeline: list of (op_index, live_bytes, phase, op_name), one row per op, live bytes
            taken right after the op's outputs were allocated (empty when
            `record_timeline=False`).
        op_count: number of ops seen.

    Phase: "backward" while the autograd engine runs a graph task (recompute inside backward
    counts as backward), else "forward"; `set_phase(name)` or `with tracker.phase(name):`
    overrides it (e.g. "optimizer"); so does the module-level `phase(name)` for code that
    does not hold the tracker. Ops after backward are "forward" unless labelled.

    Each `with` block is a fresh measurement: entering resets every statistic.
    """

    def __init__(self, record_timeline: bool = True):
        super().__init__()
        self.record_timeline = record_timeline
        self._reset()

    def _reset(self) -> None:
        self.current_bytes = 0
        self.peak_bytes = 0
        self.peak_by_phase: dict[str, int] = {}
        self.timeline: list[tuple[int, int, str, str]] = []
        self.op_count = 0
        self._phase_override: str | None = None
        # StorageImpl address -> (weakref to the UntypedStorage with a finalizer, charged bytes)
        self._live: dict[int, tuple[weakref.ref, int]] = {}
        self._active = False

    # -- phases ---------------------------------------------------------------------------

    def set_phase(self, name: str | None) -> None:
        """Label the following ops `name` (None: back to automatic forward/backward)."""
        self._phase_override = name

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label the ops inside the block `name`, then restore the previous label."""
        previous = self._phase_override
        self._phase_override = name
        try:
            yield
        finally:
            self._phase_override = previous

    def current_phase(self) -> str:
        if self._phase_override is not None:
            return self._phase_override
        return BACKWARD if torch._C._current_graph_task_id() != -1 else FORWARD

    # -- context manager ------------------------------------------------------------------

    def __enter__(self):
        self._reset()
        self._active = True
        _active_trackers.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._active = False
            _active_trackers.remove(self)
            # Dropping the weakrefs unregisters their finalizers: the numbers stay frozen.
            self._live.clear()

    # -- tracking -------------------------------------------------------------------------

    def _on_storage_freed(self, key: int, ref: weakref.ref) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[0] is ref:
            del self._live[key]
            self.current_bytes -= entry[1]

    def _charge(self, st: torch.UntypedStorage) -> None:
        key = st._cdata
        nbytes = st.nbytes()
        entry = self._live.get(key)
        if entry is not None:  # already tracked: only a resize changes the charge
            if entry[1] != nbytes:
                self.current_bytes += nbytes - entry[1]
                self._live[key] = (entry[0], nbytes)
            return
        if st.device.type == "meta":  # e.g. a FakeTensor's storage: no memory behind it
            return
        ref = weakref.ref(st, lambda r, key=key: self._on_storage_freed(key, r))
        self._live[key] = (ref, nbytes)
        self.current_bytes += nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self._active:
            return out
        input_keys = None
        for leaf in _leaves(out):
            st = _storage(leaf)
            if st is None:
                continue
            if st._cdata not in self._live:
                if input_keys is None:
                    input_keys = _storage_keys(args, kwargs)
                if st._cdata in input_keys:  # a view / in-place result of an untracked storage
                    continue
            self._charge(st)
        self._record(func)
        return out

    def _record(self, func) -> None:
        phase = self.current_phase()
        live = self.current_bytes
        if live > self.peak_bytes:
            self.peak_bytes = live
        if live > self.peak_by_phase.get(phase, -1):
            self.peak_by_phase[phase] = live
        if self.record_timeline:
            self.timeline.append((self.op_count, live, phase, str(func)))
        self.op_count += 1

    def timeline_frame(self) -> pd.DataFrame:
        """The timeline as a DataFrame with columns op_index, live_bytes, phase, op."""
        import pandas as pd

        return pd.DataFrame(self.timeline, columns=list(TIMELINE_COLUMNS))


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Label the ops inside the block `name` in every active tracker (no-op without one).

    For step functions that do not hold the tracker, e.g. `with phase("optimizer"): opt.step()`.
    """
    with ExitStack() as stack:
        for tracker in list(_active_trackers):
            stack.enter_context(tracker.phase(name))
        yield


def measure_callable_peak(fn, *args, **kwargs) -> tuple[object, int]:
    """Run `fn(*args, **kwargs)` under a `MemoryTracker`; return (result, peak bytes).

    The peak counts only storages created during the call (bytes, exact on CPU)."""
    with MemoryTracker(record_timeline=False) as tracker:
        result = fn(*args, **kwargs)
    return result, tracker.peak_bytes
