"""Peak memory and time of the LM head + cross-entropy: naive vs hbp.ops.chunked_cross_entropy.

    python experiments/bench_chunked_ce.py [--quick] [--tokens 1024 4096] [--chunk-sizes 166 666]

One fwd+bwd of the loss of `hidden [N, D] @ weight.T` (GPT-2 head: V=50257, D=768, float32,
CPU, 2 threads) per measurement, with hidden and weight requiring grad:
  naive                F.cross_entropy(hidden @ weight.T, target)
  chunked              chunked_cross_entropy(...) as shipped (gradients formed in forward)
  chunked_recompute    the same with the logits recomputed in backward
  (each chunked variant at the default chunk size and at every --chunk-sizes value).
peak_bytes: MemoryTracker peak (exact live storages, gradients of hidden and weight
included, as docs/architecture.md defines it). time: median of --repeats timed runs without the
tracker, after one warm-up run; variants are interleaved round by round so that machine load
drifts hit all of them alike. cpu_time (time.process_time, all threads of this process) is
reported next to it: on a shared machine it is the steadier measure of the work done. Writes outputs/bench/chunked_ce.csv and .md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from hbp.ops.chunked_ce import _chunked_cross_entropy, default_chunk_size
from hbp.runtime.tracker import MemoryTracker
from hbp.units import MIB


def naive_loss(hidden, weight, target):
    return F.cross_entropy(hidden @ weight.T, target)


def chunked_loss(hidden, weight, target, *, chunk_size, grads_in_forward):
    return _chunked_cross_entropy(
        hidden,
        weight,
        target,
        None,
        chunk_size,
        -100,
        "mean",
        0.0,
        grads_in_forward=grads_in_forward,
    )


def variants(num_rows: int, vocab: int, chunk_sizes: list[int]) -> dict:
    """name -> (chunk_size or None, loss function of (hidden, weight, target))."""
    out = {"naive": (None, naive_loss)}
    sizes = [default_chunk_size(num_rows, vocab), *chunk_sizes]
    for size in dict.fromkeys(sizes):
        tag = "" if size == sizes[0] else f"@{size}"
        for name, fused in (("chunked", True), ("chunked_recompute", False)):
            out[name + tag] = (size, partial(chunked_loss, chunk_size=size, grads_in_forward=fused))
    return out


def step(loss_fn, hidden, weight, target) -> None:
    hidden.grad = weight.grad = None
    loss_fn(hidden, weight, target).backward()


def measure(num_rows, vocab, dim, chunk_sizes, repeats, seed=0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_rows, dim, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=gen) * 0.02).requires_grad_()
    target = torch.randint(0, vocab, (num_rows,), generator=gen)
    cases = variants(num_rows, vocab, chunk_sizes)

    rows = {}
    for name, (chunk_size, loss_fn) in cases.items():
        with MemoryTracker(record_timeline=False) as tracker:
            step(loss_fn, hidden, weight, target)
        rows[name] = dict(
            tokens=num_rows,
            vocab=vocab,
            dim=dim,
            variant=name,
            chunk_size=chunk_size,
            peak_bytes=tracker.peak_bytes,
            times=[],
            cpu_times=[],
        )
    for _ in range(repeats + 1):  # round 0 is the warm-up
        for name, (_, loss_fn) in cases.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            step(loss_fn, hidden, weight, target)
            rows[name]["times"].append(time.perf_counter() - start)
            rows[name]["cpu_times"].append(time.process_time() - cpu_start)
    hidden.grad = weight.grad = None

    naive = rows["naive"]
    naive_time = statistics.median(naive["times"][1:])
    naive_cpu_time = statistics.median(naive["cpu_times"][1:])
    out = []
    for row in rows.values():
        times = row.pop("times")[1:]
        cpu_median = statistics.median(row.pop("cpu_times")[1:])
        median = statistics.median(times)
        out.append(
            dict(
                row,
                peak_mib=row["peak_bytes"] / MIB,
                peak_ratio=row["peak_bytes"] / naive["peak_bytes"],
                time_median_s=median,
                time_min_s=min(times),
                time_max_s=max(times),
                time_ratio=median / naive_time,
                cpu_time_s=cpu_median,
                cpu_time_ratio=cpu_median / naive_cpu_time,
                grads_mib=(num_rows + vocab) * dim * 4 / MIB,
            )
        )
    return out


def to_markdown(frame: pd.DataFrame) -> str:
    cols = [
        "tokens",
        "variant",
        "chunk_size",
        "peak_mib",
        "peak_ratio",
        "time_median_s",
        "time_min_s",
        "time_max_s",
        "time_ratio",
        "cpu_time_ratio",
    ]
    fmt = {
        "peak_mib": "{:.1f}",
        "peak_ratio": "{:.3f}",
        "time_median_s": "{:.3f}",
        "time_min_s": "{:.3f}",
        "time_max_s": "{:.3f}",
        "time_ratio": "{:.2f}",
        "cpu_time_ratio": "{:.2f}",
    }
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in frame.iterrows():
        cells = []
        for c in cols:
            v = r[c]
            if c == "chunk_size":
                cells.append("-" if pd.isna(v) else str(int(v)))
            else:
                cells.append(fmt[c].format(v) if c in fmt else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1024 tokens, 3 timed runs")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument(
        "--chunk-sizes",
        type=int,
        nargs="*",
        default=[],
        help="extra chunk sizes to compare with the default",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench"))
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.repeats = [1024], 3
    torch.set_num_threads(args.threads)

    records = []
    for num_rows in args.tokens:
        records += measure(num_rows, args.vocab, args.dim, args.chunk_sizes, args.repeats)
        print(f"done: {num_rows} tokens", file=sys.stderr, flush=True)
    frame = pd.DataFrame.from_records(records)
    table = to_markdown(frame)
    header = (
        f"LM head + cross-entropy fwd+bwd, V={args.vocab}, D={args.dim}, float32, CPU, "
        f"{args.threads} threads; peak = MemoryTracker bytes (grads included), "
        f"time = wall-clock median of {args.repeats} (min-max shown); cpu_time_ratio: median process CPU time vs naive's (less sensitive to other load on the machine)\n\n"
    )
    print(header + table)
    args.out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out / "chunked_ce.csv", index=False)
    (args.out / "chunked_ce.md").write_text(header + table)
    return frame


if __name__ == "__main__":
    main()
