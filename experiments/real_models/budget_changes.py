"""A budget changed during training: `hc.budget = ...` between steps plans again from the
capture already made.

    OMP_NUM_THREADS=1 python experiments/real_models/budget_changes.py [--steps 6]

A Qwen2 decoder built from its config (4 layers, hidden 128, attention dropout 0.1, random
weights, 2 x 128 tokens) trained with AdamW in `HCModule(model, budget=0.5)`; before steps 3
and 5 the budget becomes "min", then 0.4. A plain copy trains beside it on the same batches and
dropout seeds. Per step: the loss of each (equal or not), the largest parameter-gradient
difference, captures made during the step, the step's wall seconds (the first pays capture and
plan, a step after a change the plan only), the plan's budget and predicted peak and the
allocator's peak of the step (CPU: the profiler's memory events), in MiB.
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch

import hbp
import hbp.integrations.torch.planning as planning
from hbp.allocator import allocator_peak
from hbp.units import MIB

#: The budget set before these steps (the first step's is 0.5).
SCHEDULE = {3: "min", 5: 0.4}


def qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        attention_dropout=0.1, tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    steps = parser.parse_args().steps
    torch.set_num_threads(1)
    captures = []
    capture = planning.capture
    planning.capture = lambda *a, **k: captures.append(1) or capture(*a, **k)
    torch.manual_seed(0)
    model = qwen2()
    plain = copy.deepcopy(model)
    hc = hbp.HCModule(model, budget=0.5)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, plain)]
    generator = torch.Generator().manual_seed(1)
    print("| step | budget | loss (hbp = plain) | max grad diff | captures | step s | "
          "plan budget | predicted | measured | plain |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for step in range(1, steps + 1):
        ids = torch.randint(0, 1000, (2, 128), generator=generator)
        batch = {"input_ids": ids, "labels": ids}
        if step in SCHEDULE:
            hc.budget = SCHEDULE[step]
        results = []
        for module in (hc, plain):
            for o in optimizers:
                o.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)  # the same dropout masks in both

            def run(module=module, batch=batch):
                loss = module(**batch).loss
                loss.backward()
                return loss.detach()

            before, start = len(captures), time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loss, peak = allocator_peak(run)
            results.append((loss, peak, time.perf_counter() - start, len(captures) - before))
            if module is hc:
                grads = [p.grad.clone() for p in model.parameters()]
        (loss, peak, seconds, made), (plain_loss, plain_peak, _, _) = results
        diff = max((g - p.grad).abs().max().item() for g, p in zip(grads, plain.parameters()))
        plan = hc.plan
        equal = "equal" if torch.equal(loss, plain_loss) else f"{loss:.6f} vs {plain_loss:.6f}"
        print(
            f"| {step} | {hc.budget} | {equal} | {diff:.1e} | {made} | {seconds:.2f} | "
            f"{plan.budget_bytes / MIB:.3f} | {plan.predicted_peak_bytes / MIB:.3f} | "
            f"{peak / MIB:.3f} | {plain_peak / MIB:.3f} |",
            flush=True,
        )
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        for o in optimizers:
            o.step()


if __name__ == "__main__":
    main()
