"""`measure`: the memory of one call of a JAX function."""

from __future__ import annotations

import gc
import resource
import time
from dataclasses import dataclass, field
from typing import Any

import jax

from hbp.integrations.jax.recording import PieceRecord, record_pieces


@dataclass
class MemoryReport:
    """Memory of one call of a JAX function (bytes).

    Attributes:
        strategy: what ran: "pieces" (hbp's separately compiled pieces), "fenced" or "remat"
            (hbp's one jitted program of that executor), or "one program" (`fn` is not an
            hbp function running eagerly, e.g. `jax.jit(hbp_fn)`: measured as `jax.jit(fn)`).
        peak_bytes: max over the compiled programs that ran of: live array bytes when it
            started (above the level before the call) + its temp + its output bytes. For
            "one program": temp + output (its arguments exist before the call).
        temp_bytes / output_bytes / argument_bytes: of the program (pieces: of the piece at
            the peak).
        n_pieces: compiled programs that ran.
        rss_growth_bytes: process max-RSS during the measured run minus RSS before it (0
            where memory released after the baseline kept it below; -1 when the high-water
            mark could not be reset: then it is a lower bound only).
        wall_s: seconds of the measured run.
        pieces: the per-piece records (pieces strategy).
    """

    strategy: str
    peak_bytes: int
    temp_bytes: int
    output_bytes: int
    argument_bytes: int
    n_pieces: int
    rss_growth_bytes: int
    wall_s: float
    pieces: list[PieceRecord] = field(default_factory=list, repr=False)


def measure(fn, *args) -> MemoryReport:
    """Measure one call of `fn(*args)` (after a warm-up call that compiles everything).

    If `fn` runs hbp's compiled programs eagerly (a `height_compressed_grad` function, or
    `jax.grad` of a `height_compressed` one), the programs that ran are reported; otherwise
    `fn` is measured as one `jax.jit(fn)` program (a function that is already jitted, e.g.
    `hbp.jax.jit(fn)`, is measured as it is, with its compiler options). RSS: `/proc/self/clear_refs` resets the high-water mark right
    before the run (Linux); freed memory that the allocator keeps can hide growth, so run in
    a fresh process with `MALLOC_MMAP_THRESHOLD_` set (as `experiments/bench_jax.py` does) for
    a sharp number.
    """
    with record_pieces() as warm:
        jax.block_until_ready(fn(*args))
    if warm.records:
        run, analysis = fn, None
    else:
        run = fn if hasattr(fn, "lower") else jax.jit(fn)  # keep a jit's compiler options
        analysis = run.lower(*args).compile().memory_analysis()
        jax.block_until_ready(run(*args))
    with record_pieces() as rec:
        growth, wall, _ = rss_growth(run, *args)
    if analysis is not None:
        temp, outb = int(analysis.temp_size_in_bytes), int(analysis.output_size_in_bytes)
        return MemoryReport(
            "one program",
            temp + outb,
            temp,
            outb,
            int(analysis.argument_size_in_bytes),
            1,
            growth,
            wall,
        )
    top = max(rec.records, key=lambda r: r.peak_bytes)
    programs = [r.name for r in rec.records if r.name.startswith("one program (")]
    return MemoryReport(
        programs[0][len("one program (") : -1] if programs else "pieces",
        top.peak_bytes,
        top.temp_bytes,
        top.output_bytes,
        top.argument_bytes,
        len(rec.records),
        growth,
        wall,
        rec.records,
    )


def rss_growth(fn, *args) -> tuple[int, float, Any]:
    """(process max-RSS growth in bytes, seconds, the output) of one call of `fn(*args)` as
    it is (warm it up first: compilation counts too), from the resident size once memory
    still being released has been (NOTE [ RSS baseline after a previous call ]). The growth
    is -1 where the high-water mark cannot be reset (then only a lower bound is known), and
    0 where the process held less throughout the call than at the baseline (memory still
    being released after it was read)."""
    gc.collect()
    rss_before = _settled_rss()
    reset = _reset_rss_peak()
    start = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    wall = time.perf_counter() - start
    growth = max(0, _max_rss() - rss_before) if reset else -1
    return growth, wall, out


# NOTE [ RSS baseline after a previous call ]
# On XLA:CPU, `block_until_ready` returns once a program's outputs are ready; its temp buffer
# is freed after that, and unmapping hundreds of MiB takes a noticeable time. A baseline read
# in that window still holds the previous call's temp, so the next call's growth is measured
# from too high a level and a large program looks smaller than it is (the error grows with the
# program's temp: it hits `jax.jit(jax.grad(f))` hardest, and makes a saving look smaller).
# The baseline is therefore read once the resident size has stopped falling. Figures:
# docs/jax.md "One program's memory against the plan".


def _settled_rss(timeout_s: float = 3.0, interval_s: float = 0.02, calm: int = 4) -> int:
    """The resident size once memory that is being released has been (NOTE [ RSS baseline
    after a previous call ]): polled until it has not fallen by 1 MiB or more in `calm`
    intervals in a row, at most `timeout_s`."""
    deadline = time.perf_counter() + timeout_s
    rss, still = _current_rss(), 0
    while still < calm and time.perf_counter() < deadline:
        time.sleep(interval_s)
        now = _current_rss()
        still = still + 1 if now > rss - 2**20 else 0
        rss = min(rss, now)
    return _current_rss()


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
