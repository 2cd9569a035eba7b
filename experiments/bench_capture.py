"""Capture and scratch-calibration time of the issue's transformers Llama (`llama`, which
`bench_planner_real` uses too: defined here, with no hbp import, so that an older hbp on
PYTHONPATH can run this script), and a field-by-field comparison of the IR two code versions capture.

    OMP_NUM_THREADS=1 python experiments/bench_capture.py time 2 8 32 64
    OMP_NUM_THREADS=1 python experiments/bench_capture.py time 2 8 32 --dump /tmp/ir_after
    python experiments/bench_capture.py compare /tmp/ir_before /tmp/ir_after
    OMP_NUM_THREADS=1 python experiments/bench_capture.py time 12 --gpt2 --dump /tmp/ir_after

`--gpt2` times GPT-2 124M at the bench's medium profile (8 x 1024 tokens, ~10 GB; the number
given is ignored) instead of the Llama.

`time` runs each depth in a fresh process (the calibration cache is per process, as in a
user's first step) and prints CPU seconds (`time.process_time`) of
`capture(WithLoss(model, loss_fn, 1), args, kwargs)` and then of
`calibrate_scratch(captured, args, kwargs)`. With `--dump DIR` each process also writes the
captured, calibrated IR to DIR/llama<N>.pkl: every node's fields, the graph's other fields, its
meta but timings, the fx graph's code and the `CapturedGraph`'s other fields. `compare` reports
every difference between two such folders (run `time --dump` once per code version, e.g. from
a `git archive` of the older commit on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path


def llama(layers: int):
    """(model, args, kwargs, loss_fn) of the Llama decoder the planner benchmarks use at
    `layers` layers (hidden 128, 4 heads, vocab 2048, 2 x 128 tokens)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=344,
        vocab_size=2048,
        num_hidden_layers=layers,
        max_position_embeddings=256,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        ids = torch.randint(0, cfg.vocab_size, (2, 128))
    return model, (ids,), {"labels": ids}, lambda out: out.loss


def gpt2_medium():
    """(model, args, kwargs, loss_fn) of GPT-2 124M at the bench's medium profile."""
    from hbp.workloads import build

    wl = build("gpt2", "medium", seed=0)
    batch = wl.make_batch(0)
    return wl.model, tuple(batch.args), dict(batch.kwargs), lambda out: wl.loss_fn(out, batch)


def one(layers: int, dump: str | None, gpt2: bool = False) -> None:
    """Time one depth (or GPT-2) in this process (and dump its IR)."""
    import torch

    from hbp.graph.torch.calibrate import calibrate_scratch
    from hbp.graph.torch.capture import capture
    from hbp.integrations.torch.loss import WithLoss

    torch.set_num_threads(1)
    model, args, kwargs, loss_fn = gpt2_medium() if gpt2 else llama(layers)
    root = WithLoss(model, loss_fn, len(args))
    start = time.process_time()
    with torch.enable_grad():
        captured = capture(root, args, kwargs)
    captured_at = time.process_time()
    calibrate_scratch(captured, args, kwargs)
    done = time.process_time()
    graph = captured.graph
    print(
        f"| {layers} | {len(graph.nodes)} | {captured_at - start:.2f} | {done - captured_at:.2f} |",
        flush=True,
    )
    if dump:
        Path(dump).mkdir(parents=True, exist_ok=True)
        ir = {
            "nodes": [dataclasses.asdict(n) for n in graph.nodes],
            "graph": {k: v for k, v in vars(graph).items() if k not in ("nodes", "meta")},
            "meta": {k: repr(v) for k, v in graph.meta.items() if "time" not in k},
            "code": captured.gm.code if captured.gm is not None else None,
            "captured": {
                k: repr(v)
                for k, v in vars(captured).items()
                if k not in ("graph", "gm", "capture_time_s")
            },
        }
        with open(Path(dump) / ("gpt2.pkl" if gpt2 else f"llama{layers}.pkl"), "wb") as f:
            pickle.dump(ir, f)


def compare(before: Path, after: Path) -> int:
    """Print every difference between the IR dumps of two folders; the number found."""
    total = 0
    for path in sorted(before.glob("*.pkl")):
        a = pickle.loads(path.read_bytes())
        b = pickle.loads((after / path.name).read_bytes())
        diffs: list[str] = []
        if len(a["nodes"]) != len(b["nodes"]):
            diffs.append(f"node count {len(a['nodes'])} != {len(b['nodes'])}")
        fields = 0
        for x, y in zip(a["nodes"], b["nodes"]):
            for key in x.keys() | y.keys():
                fields += 1
                if x.get(key) != y.get(key):
                    diffs.append(f"{x.get('name')}.{key}: {x.get(key)!r} != {y.get(key)!r}")
        diffs += [part for part in ("graph", "meta", "code", "captured") if a[part] != b[part]]
        total += len(diffs)
        print(f"{path.name}: {len(a['nodes'])} nodes, {fields} node fields, {len(diffs)} differ")
        for line in diffs[:20]:
            print("   ", line)
    print(f"{total} differences")
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    timing = sub.add_parser("time")
    timing.add_argument("layers", type=int, nargs="+")
    timing.add_argument("--dump", default=None)
    timing.add_argument("--gpt2", action="store_true")
    timing.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    comparing = sub.add_parser("compare")
    comparing.add_argument("before", type=Path)
    comparing.add_argument("after", type=Path)
    opts = parser.parse_args()
    if opts.command == "compare":
        sys.exit(1 if compare(opts.before, opts.after) else 0)
    if opts.in_process:
        one(opts.layers[0], opts.dump, opts.gpt2)
        return
    print("| layers | nodes | capture (CPU s) | calibration (CPU s) |\n|---:|---:|---:|---:|")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for n in opts.layers:
        command = [sys.executable, __file__, "time", str(n), "--in-process"]
        command += ["--dump", opts.dump] if opts.dump else []
        command += ["--gpt2"] if opts.gpt2 else []
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        print(next(line for line in out.stdout.splitlines() if line.startswith("|")), flush=True)


if __name__ == "__main__":
    main()
