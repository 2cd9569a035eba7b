"""Every CUDA path of hbp checked in one command, for the few minutes a GPU is lent.

    python experiments/gpu_check.py --out outputs/gpu_check          # one CUDA device
    python experiments/gpu_check.py --cpu --out /tmp/gpu_check       # the same checks on CPU
    make gpu-check                                                    # the first line

Checks (experiments/gpu_checks/sizes.py; each in its own process, under its own time limit):
  pytest_gpu      the tests marked `gpu` (`pytest -m gpu` over the files that have them)
  gpt2_small, unet, llama, gpt2_medium
                  naive, uniform checkpointing, the library's own checkpointing, hbp at 0.5,
                  0.3, "min" and at the checkpointing's measured peak: allocator peak (max_memory_allocated above the level before
                  the step), reserved peak, predicted peak, recompute FLOPs, median step time,
                  gradient difference against plain autograd; and the kernel workspace hbp
                  measured at capture (convolution and attention kernels must be measured)
  chunked_ce      hbp.ops.chunked_cross_entropy against the plain loss (vocab 50257, 8k tokens)
  bf16_autocast   hbp@0.5 under bf16 autocast against plain autograd under it
  ddp             DDP(HCModule) over NCCL when two or more devices are visible, else skipped
  trainer         hbp.enable(model) at its default budget under transformers' Trainer against
                  the plain Trainer run: losses, then one step's peak and gradients
  compile         torch.compile(HCModule(model, 0.5)) against plain eager autograd

Writes `gpu_check.json` and `gpu_check.md` under --out (gpu_checks/report.py says how each row
is judged). Exit status: 0 every check passed; 1 a check failed (a gradient mismatch, a peak
above 1.05x its budget, an error, a timeout, an unmeasured workspace); 2 no CUDA device (and
no --cpu); 3 a package the checks need cannot be imported.

--cpu runs the same checks on the CPU with tiny shapes (peaks from the CPU allocator's
profiler events, no reserved memory, no DDP): it tests this script's logic where there is no
GPU (tests/test_gpu_check.py), so that a lent GPU's minutes go to measuring.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "experiments")]

#: Modules the checks import; a missing one stops the run before any check (exit 3).
REQUIRED = ("torch", "numpy", "highspy", "omegaconf", "transformers", "pytest", "hbp")
EXIT_FAILED, EXIT_NO_CUDA, EXIT_MISSING = 1, 2, 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/gpu_check"))
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="run the same checks on the CPU with tiny shapes (tests the script without a GPU)",
    )
    parser.add_argument("--only", nargs="*", help="run only these checks (names as in the table)")
    parser.add_argument("--time-limit", type=float, help="the run's deadline in seconds")
    parser.add_argument(
        "--jobs", type=int, help="checks run at once (default: 1 on CUDA, clean timings; 2 on CPU)"
    )
    parser.add_argument(
        "--digest", action="store_true", help="print the sources' digest (`source_digest`)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # run one check (internal)
    parser.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.digest:
        print(source_digest())
        return 0
    if args.worker:
        return _worker(args.worker, "cpu" if args.cpu else "cuda", args.rows)
    return _run(args)


def preflight(cpu: bool) -> tuple[int, dict]:
    """(exit status, environment): 0 when the checks can start; else the reason is printed."""
    try:
        import torch
    except Exception:  # noqa: BLE001 - reported with the other missing packages below
        torch = None
    if torch is not None and not cpu and not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device visible (torch {torch.__version__}, built with CUDA "
            f"{torch.version.cuda}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
            ": run it on a machine with a GPU, or pass --cpu to check the script on the CPU.",
            file=sys.stderr,
        )
        return EXIT_NO_CUDA, {}
    missing = []
    for name in REQUIRED:
        try:
            __import__(name)
        except Exception as error:  # noqa: BLE001 - any import failure is a missing package
            missing.append(f"{name} ({type(error).__name__}: {error})")
    if missing:
        print(
            "gpu_check: cannot import " + "; ".join(missing) + ". Install hbp's dependencies "
            "(make install); on a machine without a registry carry the wheels and run "
            "`make gpu-check GPU_PYTHON=python3 WHEELS=<folder>` (docs/results.md, CUDA).",
            file=sys.stderr,
        )
        return EXIT_MISSING, {}
    import transformers

    env = {
        "torch": torch.__version__,
        "torch_pinned": _pinned_torch(),
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "git_sha": _git_sha(),
        "source_digest": source_digest(),
        "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    if cpu:
        env["device_name"] = "CPU (--cpu: tiny shapes)"
        return 0, env
    props = torch.cuda.get_device_properties(0)
    env.update(device_name=props.name, device_memory_bytes=props.total_memory)
    env["capability"] = f"{props.major}.{props.minor}"
    return 0, env


def _run(args) -> int:
    from gpu_checks import report, sizes

    started = time.perf_counter()
    status, env = preflight(args.cpu)
    if status:
        return status
    checks_started = time.perf_counter()  # the deadline counts from here
    device = "cpu" if args.cpu else "cuda"
    limit = args.time_limit or sizes.RUN_LIMIT_S[device]
    document = {"device": device, "environment": env, "checks": {}, "run_limit_s": limit}
    document["tolerance"] = report.TOLERANCE
    document["budget_slack"] = report.BUDGET_SLACK
    selected = [c for c in sizes.checks(device) if not args.only or c.name in args.only]
    jobs = args.jobs or sizes.JOBS[device]

    def run(check, scratch: Path) -> dict:
        left = limit - (time.perf_counter() - checks_started)
        if check.kind == "ddp" and (args.cpu or env["device_count"] < 2):
            result = {"rows": [ddp_skipped(check, env["device_count"])]}  # no process needed
        elif left < sizes.MIN_START_S:
            result = {"rows": [], "error": f"not run: {left:.0f} s left of the run's {limit:.0f} s"}
        else:
            result = _run_check(check, args.cpu, min(check.limit_s, left), scratch)
        print(f"gpu_check: {check.name}: {_one_line(result, report)}", flush=True)
        return result

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
        with ThreadPoolExecutor(max_workers=jobs) as pool:  # NOTE [ Fitting the lease ]
            futures = {c.name: pool.submit(run, c, Path(scratch)) for c in selected}
        document["checks"] = {name: future.result() for name, future in futures.items()}
    document["wall_s"] = time.perf_counter() - started
    report.summarize(document)
    json_path, md_path = report.write(document, args.out)
    print(md_path.read_text())
    print(f"gpu_check: wrote {json_path} and {md_path}")
    return 0 if document["ok"] else EXIT_FAILED


def ddp_skipped(check, visible: int) -> dict:
    """The DDP check's row where it cannot run: it needs two CUDA devices."""
    return {
        "model": check.model.describe(),
        "variant": "DDP(hbp@0.5) x2",
        "dtype": "float32",
        "status": "skipped",
        "note": f"{visible} CUDA device(s) visible: DDP over NCCL needs 2 or more",
    }


def _run_check(check, cpu: bool, limit_s: float, scratch: Path) -> dict:
    """Run one check in a child process; its rows come back through a JSON file it rewrites
    after every row, so a crash or a timeout keeps the rows done before it."""
    rows_path = scratch / f"{check.name}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", check.name]
    command += ["--rows", str(rows_path)] + (["--cpu"] if cpu else [])
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    env.setdefault("WANDB_MODE", "disabled")
    started = time.perf_counter()
    result: dict = {"limit_s": round(limit_s, 1)}
    # Its own process group: a timeout ends the check's children too (pytest, DDP's ranks),
    # which would otherwise hold the device while the next checks run.
    child = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        _, stderr = child.communicate(timeout=limit_s)
        if child.returncode != 0:
            result["error"] = f"exit status {child.returncode}: {_tail(stderr)}"
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        _, stderr = child.communicate()
        result["error"] = f"timeout: still running after {limit_s:.0f} s (its time limit)"
        result["stderr_tail"] = _tail(stderr)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if rows_path.exists():
        rows = json.loads(rows_path.read_text())
        errors = [e for e in (result.get("error"), rows.pop("error", None)) if e]
        result.update(rows)
        if errors:
            result["error"] = "; ".join(errors)
    return result


def _worker(name: str, device: str, rows_path: Path) -> int:
    """Run the check `name` in this process, writing its rows to `rows_path` as they come."""
    from gpu_checks import sizes

    os.environ.setdefault("WANDB_MODE", "disabled")
    check = next(c for c in sizes.checks(device) if c.name == name)
    result: dict = {"rows": []}

    def record(row: dict) -> None:
        result["rows"].append({k: v for k, v in row.items() if k != "grads"})
        _write(result, rows_path)

    steps = sizes.TIMED_STEPS[device]
    if os.environ.get("GPU_CHECK_HANG") == name:  # tests: a check that never ends, with a child
        record({"variant": "before the hang", "status": "ok"})
        subprocess.run([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        if check.kind == "pytest":
            result.update(_pytest(device))
        elif check.kind == "model":
            from gpu_checks import models

            models.run_model_check(check.model, device, steps, record)
        else:
            from gpu_checks import extras, trainer

            run = {
                "chunked_ce": lambda: extras.run_chunked_ce_check(
                    check.options, device, steps, record
                ),
                "bf16": lambda: extras.run_bf16_check(check.model, device, steps, record),
                "compile": lambda: extras.run_compile_check(check.model, device, steps, record),
                "ddp": lambda: extras.run_ddp_check(check.model, device, steps, record),
                "trainer": lambda: trainer.run_trainer_check(check.model, device, steps, record),
            }
            run[check.kind]()
    except Exception as error:  # noqa: BLE001 - the check's own error, beside its rows
        result["error"] = f"{type(error).__name__}: {error}"[:600]
        result["traceback"] = traceback.format_exc()[-3000:]
    _write(result, rows_path)
    return 0


def _write(result: dict, rows_path: Path) -> None:
    tmp = rows_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=str))
    tmp.replace(rows_path)


def _pytest(device: str) -> dict:
    """`pytest -m gpu` over the test files that hold a `gpu` mark (the others are not even
    imported, so a bench-only dependency cannot stop it)."""
    files = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").glob("test_*.py")
        if "pytest.mark.gpu" in p.read_text()
    )
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    command += ["-n", "0", *files]
    env = dict(os.environ, WANDB_MODE="disabled")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    ok = done.returncode in (0, 5)  # 5: every test deselected or none collected
    return {
        "summary": f"pytest -m gpu over {len(files)} files: {last}",
        "pytest_files": files,
        "pytest_tail": _tail(done.stdout, 4000),
        "error": None if ok else f"pytest exit status {done.returncode}: {last}",
    }


def _one_line(result: dict, report) -> str:
    failures = report.check_failures(result)
    rows = result.get("rows", [])
    statuses = ", ".join(f"{r['variant']} {r.get('status')}" for r in rows)
    verdict = "FAILED: " + "; ".join(failures)[:300] if failures else "ok"
    return f"{verdict} ({result.get('wall_s', 0):.0f} s) {statuses}"


def _tail(text, n: int = 1500) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    lines = [ln for ln in (text or "").splitlines() if not ln.startswith("USDT:")]
    return "\n".join(lines)[-n:]


def _pinned_torch() -> str | None:
    """The torch version `make` installs (the Makefile's pin; a lent GPU machine runs its
    own torch, which pyproject.toml's range allows)."""
    text = (ROOT / "Makefile").read_text()
    start = text.find("'torch==")
    return text[start + 8 : text.find("'", start + 1)] if start >= 0 else None


def source_digest() -> str:
    """The first 12 hex digits of a SHA-256 over the library's and the experiments' Python
    sources (paths and contents): the code a run measured, where the lent copy's git HEAD is
    stale. `python experiments/gpu_check.py --digest` prints it for the checkout at hand."""
    digest = hashlib.sha256()
    for path in sorted([*ROOT.glob("hbp/**/*.py"), *ROOT.glob("experiments/**/*.py")]):
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _git_sha() -> str | None:
    """HEAD's commit, with "-dirty" where the tracked files differ from it (a lent machine's
    copy carries the working tree beside an older .git)."""
    try:
        sha = _git("rev-parse", "HEAD")
        if not sha:
            return None
        return sha + ("-dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")
    except Exception:  # noqa: BLE001 - the device machine may have no git
        return None


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    return done.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
