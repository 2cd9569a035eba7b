"""Variable-length batches: what dynamic padding costs under hbp, and what padding to a multiple
saves. Each new sequence length is a new input signature: captured, calibrated and planned on
its first step.

    OMP_NUM_THREADS=1 python experiments/variable_lengths.py            # writes the table
    OMP_NUM_THREADS=1 python experiments/variable_lengths.py --steps 6  # shorter

A transformers Qwen2 causal LM from a config (hidden 128, 4 layers, 4 heads, vocab 1000, random
weights), batch 4, trained with AdamW for `--steps` steps on batches whose longest example
(right-padded, attention mask, labels -100 on padding) has a length drawn from 48-128 tokens,
the same batches for every row. Rows: the plain model; `hbp.enable(model)` at its default budget
(new lengths run plans carried from lengths planned before, where they fit) and with
`carry_plans=False` (every length planned by the DP), with the batches as they are (a new
signature per new length), and padded to a multiple of 32 and of 128 (`pad_to_multiple_of` of
transformers' collators). Per row: wall seconds in all, in the first steps of new signatures,
the signatures, how many ran carried plans, each signature's predicted recompute (% of the step's
FLOPs) and allocator-measured peak over its budget, and the largest difference of the losses
and final parameters from the plain model's. Writes outputs/bench/variable_lengths.md.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parents[1] / "outputs" / "bench"
LENGTHS = (64, 96, 64, 128, 48, 96, 80, 64, 112, 128, 48, 96)
VOCAB, PAD, BATCH = 1000, 0, 4


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=344,
        vocab_size=VOCAB,
        pad_token_id=PAD,
        max_position_embeddings=256,
    )
    return Qwen2ForCausalLM(config)


def batches(steps: int, multiple: int | None) -> list[dict]:
    """Right-padded batches of the lengths in `LENGTHS` (one example as long as the batch,
    the others shorter), padded on to a multiple of `multiple` where given."""
    generator = torch.Generator().manual_seed(123)
    out = []
    for step in range(steps):
        longest = LENGTHS[step % len(LENGTHS)]
        lengths = torch.randint(longest // 2, longest + 1, (BATCH,), generator=generator)
        lengths[0] = longest
        width = longest if multiple is None else -(-longest // multiple) * multiple
        ids = torch.randint(3, VOCAB, (BATCH, width), generator=generator)
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        ids = ids.masked_fill(mask == 0, PAD)
        out.append(
            {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        )
    return out


def train(model, data: list[dict], engine=None) -> dict:
    """Train on `data`; wall seconds, losses, and per new signature its first step's seconds
    and measured peak over budget."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen, first_steps, ratios, losses, carried, recompute = set(), 0.0, [], [], 0, []
    started = time.perf_counter()
    for step, batch in enumerate(data):
        shape = tuple(batch["input_ids"].shape)
        torch.manual_seed(1000 + step)  # dropout and the like draw alike in both runs
        t0 = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds = time.perf_counter() - t0
        losses.append(loss.item())
        if shape not in seen:
            seen.add(shape)
            first_steps += seconds
            if engine is not None:
                hc = engine()
                ratios.append(hc.measured_peak_bytes / hc.compiled.budget_bytes)
                carried += hc.compiled.plan.meta.get("solved_by") == "carried"
                recompute.append(hc.compiled.plan.predicted_recompute_ratio)
    return {
        "seconds": time.perf_counter() - started,
        "first_steps": first_steps,
        "signatures": len(seen),
        "ratios": ratios,
        "carried": carried,
        "recompute": recompute,
        "losses": losses,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def main(argv: list[str] | None = None) -> int:
    import hbp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=len(LENGTHS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    base = qwen2()
    lines = [
        "| batches | run | wall s | in first steps of new signatures | signatures | carried "
        "| recompute (each signature) | peak / budget (each signature) | max loss diff "
        "| max parameter diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, multiple in (("as collated", None), ("padded to 32", 32), ("padded to 128", 128)):
        data = batches(args.steps, multiple)
        plain = train(copy.deepcopy(base), data)
        rows = [("plain", plain, None)]
        for name, options in (
            ("hbp.enable, default budget", {}),
            ("hbp.enable, carry_plans=False", {"carry_plans": False}),
        ):
            if multiple == 128 and options:
                continue  # one signature: nothing to carry
            model = copy.deepcopy(base)
            hbp.enable(model, **options)
            rows.append((name, train(model, data, lambda model=model: hbp.engine_of(model)), 1))
        for name, r, hbp_run in rows:
            share = f"{r['first_steps']:.1f} s ({100 * r['first_steps'] / r['seconds']:.0f}%)"
            cells = [""] * 5
            if hbp_run:
                loss_diff = max(abs(a - b) for a, b in zip(r["losses"], plain["losses"]))
                param_diff = max(
                    (a - b).abs().max().item() for a, b in zip(r["params"], plain["params"])
                )
                cells = [
                    str(r["carried"]),
                    f"{100 * min(r['recompute']):.1f}-{100 * max(r['recompute']):.1f}%",
                    f"{min(r['ratios']):.3f}-{max(r['ratios']):.3f}",
                    f"{loss_diff:.1e}",
                    f"{param_diff:.1e}",
                ]
            lines.append(
                f"| {label} | {name} | {r['seconds']:.1f} | {share} | {r['signatures']} | "
                + " | ".join(cells)
                + " |"
            )
            print(lines[-1], flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "variable_lengths.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
