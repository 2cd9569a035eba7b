"""HCModule on real models from their libraries, measured by the CPU allocator.

    python experiments/real_models/run.py                    # every model, budgets 0.5 and min
    python experiments/real_models/run.py gemma2 bart        # some of them
    python experiments/real_models/run.py --family vision    # one family's zoo
    python experiments/real_models/run.py --compile albert   # also torch.compile(HCModule(...))

The models are in this folder, one zoo per family (decoders, encoders, seq2seq, vision,
diffusion): config classes, random weights, tiny sizes, dropout off, each trained the way its
users train it (`.loss`, or an MSE on the output). What is measured: `measure.py`. Writes
outputs/real_models/<stem>.md (the table) and <stem>.json (the rows); docs/real-models.md
holds the tables.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: `real_models`
from real_models import FAMILIES, MODELS  # noqa: E402
from real_models.measure import measure_model, table  # noqa: E402

OUT = Path("outputs/real_models")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help=f"some of {', '.join(MODELS)} (default all)")
    parser.add_argument("--family", choices=sorted(FAMILIES), help="every model of one family")
    parser.add_argument("--compile", action="store_true", help="also torch.compile(hc) at 0.5")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    names = list(args.models) + list(FAMILIES.get(args.family, ()))
    names = names or list(MODELS)
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    rows = [measure_model(name, MODELS[name], compile_too=args.compile) for name in names]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "models" if set(names) == set(MODELS) else "models_" + "_".join(names)[:120]
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    (out / f"{stem}.md").write_text(
        f"`python experiments/real_models/run.py {' '.join(names)}"
        f"{' --compile' if args.compile else ''}`, torch {torch.__version__}, CPU, 1 thread\n\n"
        + table(rows)
        + "\n"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
