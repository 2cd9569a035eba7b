"""Recording the separately compiled pieces that run (their memory analysis)."""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from dataclasses import dataclass

import jax


@dataclass
class PieceRecord:
    """One compiled piece that ran: its memory analysis (bytes; `alias_bytes`: outputs that
    reuse donated arguments) and the bytes of live JAX arrays, above the level before the
    step, when it started."""

    name: str
    live_bytes: int
    temp_bytes: int
    output_bytes: int
    argument_bytes: int
    alias_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        """Live arrays + the piece's temp + its new outputs (outputs written into donated
        arguments are not new)."""
        return self.live_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes


class PieceRecorder:
    """Collects a `PieceRecord` for every piece run while it is active (`record_pieces`)."""

    def __init__(self):
        self.records: list[PieceRecord] = []
        self.baseline = live_array_bytes()
        self._stats: dict = {}

    def before(self, name: str, fn, args) -> None:
        key = (id(fn), jax.tree.structure(args), tuple(map(_sig, jax.tree.leaves(args))))
        if key not in self._stats:
            m = fn.lower(*args).compile().memory_analysis()
            self._stats[key] = (
                int(m.temp_size_in_bytes),
                int(m.output_size_in_bytes),
                int(m.argument_size_in_bytes),
                int(m.alias_size_in_bytes),
            )
        live = live_array_bytes() - self.baseline
        self.records.append(PieceRecord(name, live, *self._stats[key]))


_RECORDER: contextvars.ContextVar[PieceRecorder | None] = contextvars.ContextVar(
    "hbp_jax_recorder", default=None
)


@contextlib.contextmanager
def record_pieces():
    """Inside: every separately compiled piece hbp runs is recorded (see `PieceRecorder`)."""
    recorder = PieceRecorder()
    token = _RECORDER.set(recorder)
    try:
        yield recorder
    finally:
        _RECORDER.reset(token)


def run_compiled(name: str, fn, *args):
    """Call the jitted `fn`, recording it first if a `record_pieces` recorder is active."""
    recorder = _RECORDER.get()
    with warnings.catch_warnings():
        # Donated arguments no output can reuse are simply freed; no need to warn.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        if recorder is not None:
            recorder.before(name, fn, args)
        return fn(*args)


def live_array_bytes() -> int:
    """Bytes of all live JAX arrays (each device buffer counted once)."""
    seen, total = set(), 0
    for a in jax.live_arrays():
        try:
            ptr = a.unsafe_buffer_pointer()
        except Exception:  # noqa: BLE001 - deleted or non-addressable: count it once
            ptr = id(a)
        if ptr not in seen:
            seen.add(ptr)
            total += a.nbytes
    return total


def _sig(x):
    return (getattr(x, "shape", ()), str(getattr(x, "dtype", type(x))))
