"""python -m hbp.report <dir> [--out DIR] [--workload NAME ...]: results.parquet, the
comparison table and the figures of every run under <dir> (see hbp.report)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

#: Characters of a failed run's message the report prints.
ERROR_CHARS = 300


def _what(row) -> str:
    """The " (mode, budget B)" of a failed run, where its record has them: a sweep's directory
    names carry only a key."""
    mode, budget = row.get("mode"), row.get("mode_budget")
    if not isinstance(mode, str):
        return ""
    has_budget = budget is not None and not (isinstance(budget, float) and budget != budget)
    return f" ({mode}, budget {budget})" if has_budget else f" ({mode})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hbp.report",
        description="Gather the bench runs under ROOT into ROOT/results.parquet, print the "
        "comparison table and write pareto.png and, per workload, memory_timeline_<workload>.png "
        "and frontier_<workload>.png.",
    )
    parser.add_argument("root", help="a directory of runs, e.g. outputs/sweeps/quick")
    parser.add_argument("--out", help="where the files go (default: ROOT)")
    parser.add_argument(
        "--workload",
        action="append",
        metavar="NAME",
        help="draw the timeline and frontier of this workload only (repeatable; default: "
        "every workload under ROOT)",
    )
    args = parser.parse_args(argv)
    from hbp.report import write_report

    try:
        report = write_report(args.root, args.out, workloads=args.workload)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    failed = (report.runs.get("status") == "error").sum() if "status" in report.runs else 0
    shown = f" ({len(report.table)} in the tables)" if args.workload else ""
    repeats = (
        f", {report.repeats} older runs of the same run key left out" if report.repeats else ""
    )
    print(
        f"{len(report.runs) - failed} finished runs{shown}{repeats}, {failed} failed, "
        f"under {args.root}\n"
    )
    print(report.format())
    print()
    if failed:
        for _, row in report.runs[report.runs["status"] == "error"].iterrows():
            message = (str(row.get("error", "")).strip().splitlines() or [""])[0]
            if len(message) > ERROR_CHARS:  # cut at a word, and say so
                message = message[:ERROR_CHARS].rsplit(" ", 1)[0] + " ... (see its error.json)"
            print(f"failed: {Path(str(row.get('run_dir', ''))).name}{_what(row)}: {message}")
        print()
    for path in report.files:
        print(f"wrote {path}")
    for name, why in report.skipped.items():
        print(f"skipped {name}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
