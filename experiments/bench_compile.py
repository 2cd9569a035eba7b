"""torch.compile and HCModule on one workload: eager HCModule, compiled HCModule (each
segment compiled: `torch.compile(hc)`), and the compiled plain model (no budget).

    python experiments/bench_compile.py                      # gpt2, profile small, budget 0.5
    python experiments/bench_compile.py --workload resnet --budget 0.3 --repeats 5
    python experiments/bench_compile.py --workload transformers-gpt2   # GPT2LMHeadModel, tiny

Prints one row per variant: the step's peak by the CPU allocator (`allocator_peak`: the
profiler's allocation events, what Inductor's own buffers are counted by), that peak over the
plan's budget, the median wall and CPU (process) time of `--repeats` timed steps after
warm-up, the variants interleaved round by round (compilation happens in warm-up; its time is
printed apart), and the largest gradient difference from the eager plain model (Inductor
with `fallback_random`: the same dropout masks as eager).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._inductor.config as inductor_config

import hbp
from hbp.allocator import allocator_peak
from hbp.units import MIB
from hbp.workloads import build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="gpt2")
    parser.add_argument("--profile", default="small")
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    inductor_config.fallback_random = True  # dropout masks as eager: gradients comparable

    if args.workload == "transformers-gpt2":
        model, loss_of = transformers_gpt2(args.device)
        args.profile = "tiny GPT2Config, random weights"
    else:
        workload = build(args.workload, args.profile)
        batch = workload.make_batch(0).to(args.device)
        model = workload.model.to(args.device)

        def loss_of(runner):
            return workload.step_loss(runner, batch)

    state = {k: v.clone() for k, v in model.state_dict().items()}

    def step(runner) -> None:
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(0)
        loss_of(runner).backward()

    def grads() -> list[torch.Tensor]:
        return [p.grad.detach().clone() for p in model.parameters()]

    step(model)
    reference = grads()
    hc = hbp.HCModule(model, budget=args.budget)
    variants = {
        "eager HCModule": hc,
        "torch.compile(HCModule)": torch.compile(hc),
        "torch.compile(model), no budget": torch.compile(model),
        "eager model, no budget": model,
    }
    print(
        f"{args.workload}/{args.profile}, budget {args.budget}, {args.threads} thread(s), "
        f"torch {torch.__version__}"
    )
    rows = {}
    for name, runner in variants.items():  # warm-up (capture, plan, compile) and checks
        model.load_state_dict(state)
        start = time.perf_counter()
        step(runner)
        step(runner)
        warmup_s = time.perf_counter() - start
        error = max((g - r).abs().max().item() for g, r in zip(grads(), reference, strict=True))
        _, peak = allocator_peak(step, runner)
        rows[name] = dict(peak=peak, warmup_s=warmup_s, error=error, wall=[], cpu=[])
    for _ in range(args.repeats):  # interleaved, so that load drifts hit all variants alike
        for name, runner in variants.items():
            wall, cpu = time.perf_counter(), time.process_time()
            step(runner)
            rows[name]["wall"].append(time.perf_counter() - wall)
            rows[name]["cpu"].append(time.process_time() - cpu)
    budget = hc.plan.budget_bytes
    print(
        f"{'variant':34s} {'peak MiB':>9s} {'/budget':>8s} {'step s':>8s} {'cpu s':>8s} "
        f"{'warm-up s':>10s} {'max |grad diff|':>16s}"
    )
    for name, row in rows.items():
        print(
            f"{name:34s} {row['peak'] / MIB:9.1f} {row['peak'] / budget:8.2f} "
            f"{statistics.median(row['wall']):8.3f} {statistics.median(row['cpu']):8.3f} "
            f"{row['warmup_s']:10.1f} {row['error']:16.2e}"
        )
    segments = getattr(hc.compiled.segments_compiled, "blocks", [])  # module level: none
    print(
        f"plan budget {budget / MIB:.1f} MiB, naive peak {hc.plan.naive_peak_bytes / MIB:.1f} MiB; "
        f"{hc.captured.granularity}-level capture of {len(hc.captured.graph)} nodes, "
        f"{len(segments)} top-level segments ({sum(b.recompute for b in segments)} recomputed)"
    )


def transformers_gpt2(device: str):
    """transformers' GPT2LMHeadModel from a small GPT2Config (random weights, no download),
    the loss computed by the model from `labels`; dropout on."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=4, n_head=4, n_embd=128, n_positions=128, vocab_size=2048)
    config.bos_token_id = config.eos_token_id = 0
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).to(device).train()
    ids = torch.randint(0, config.vocab_size, (8, 128), device=device)
    return model, lambda runner: runner(input_ids=ids, labels=ids).loss


if __name__ == "__main__":
    main()
