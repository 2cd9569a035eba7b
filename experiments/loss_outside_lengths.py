"""The caller's loss outside the module, at new sequence lengths: each new length's first step,
measured by the allocator, against its budget, and the warnings it gave.

    OMP_NUM_THREADS=1 python experiments/loss_outside_lengths.py

A transformers GPT-2 from a config (hidden 64, 3 layers, 4 heads, vocab 2000, random
weights), `hbp.enable(model)` at its default budget, batch 4, AdamW, a cross-entropy computed
by the caller on `model(ids).logits` (no `labels`, no `loss_fn=`), on batches of the lengths
in `LENGTHS`, with plans carried (the default) and with `carry_plans=False`, against a deep
copy trained plainly on the same batches. Per step: the length, whether it is a new
signature, the plan's maker (`Plan.meta["solved_by"]`), the allocator-measured peak of the
signature's last measured step over its budget, the `BudgetWarning`s the step gave, and its
CPU seconds; then the largest difference of the losses and parameters from the plain model's.
Writes outputs/bench/loss_outside_lengths.md.
"""

from __future__ import annotations

import copy
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

OUT = Path(__file__).resolve().parents[1] / "outputs" / "bench"
LENGTHS = (40, 64, 52, 64, 90, 33, 120, 40)
VOCAB, BATCH = 2000, 4


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_embd=64,
        n_layer=3,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=256,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def run(carry_plans: bool) -> list[str]:
    import hbp

    model = gpt2()
    plain = copy.deepcopy(model)
    hbp.enable(model, carry_plans=carry_plans)
    engine = hbp.engine_of(model)
    optimizers = [torch.optim.AdamW(m.parameters(), 1e-3) for m in (model, plain)]
    generator = torch.Generator().manual_seed(0)
    seen, rows, loss_diff = set(), [], 0.0
    for length in LENGTHS:
        ids = torch.randint(0, VOCAB, (BATCH, length), generator=generator)
        losses = []
        for m, optimizer, timed in ((model, optimizers[0], True), (plain, optimizers[1], False)):
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always", hbp.BudgetWarning)
                torch.manual_seed(length)  # the same dropout masks in both
                start = time.process_time()
                logits = m(ids).logits
                loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                seconds = time.process_time() - start
                peak = engine.measured_peak_bytes if timed else None
            losses.append(loss.item())
            if timed:
                compiled = engine.compiled
                warned = sum(issubclass(w.category, hbp.BudgetWarning) for w in said)
                over = "" if peak is None else f"{peak / compiled.budget_bytes:.3f}"
                new = "yes" if length not in seen else ""
                made_by = compiled.plan.meta.get("solved_by", "")
                rows.append(f"| {length} | {new} | {made_by} | {over} | {warned} | {seconds:.2f} |")
        seen.add(length)
        loss_diff = max(loss_diff, abs(losses[0] - losses[1]))
    param_diff = max(
        (p - q).abs().max().item() for p, q in zip(model.parameters(), plain.parameters())
    )
    rows.append(f"\nlargest loss difference {loss_diff:.1e}, parameter difference {param_diff:.1e}")
    return rows


def main() -> None:
    torch.set_num_threads(1)
    lines = []
    for carry_plans in (True, False):
        lines += [
            f"GPT-2 (3 layers), cross-entropy outside the module, carry_plans={carry_plans}",
            "",
            "| length | new | plan made by | peak / budget | BudgetWarnings | CPU s |",
            "|---|---|---|---:|---:|---:|",
            *run(carry_plans),
            "",
        ]
        print("\n".join(lines[-len(LENGTHS) - 7 :]), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "loss_outside_lengths.md"
    path.write_text("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
