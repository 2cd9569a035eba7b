"""HCModule on a CUDA device (marked `gpu`: skipped without one; `make gpu-check` runs them):
the allocator's peak (`torch.cuda.max_memory_allocated` above the level before the step)
stays within the budget and the gradients are plain autograd's, in float32 and under bf16
autocast; the chunked cross-entropy needs a fraction of the plain loss's memory on CUDA too."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import hbp
from hbp.workloads import build

pytestmark = pytest.mark.gpu

BUDGET_SLACK = 1.05  # the allowance experiments/gpu_checks/report.py states


def _gpt2():
    workload = build("gpt2", "small", seed=0)  # activations ~12x the parameter gradients
    return workload, workload.make_batch(0).to("cuda")


def _step(module, batch, params, autocast: bool = False):
    """(allocator peak above the level before the step, gradients) of the step after two
    warm-up steps (the first plans)."""

    def step():
        for p in params:
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = module(*batch.args)
        loss.backward()

    m = hbp.measure_step(step, params=params, warmup=2, repeats=0, count_flops=False,
                         track_tensors=False, record_timeline=False, device="cuda")  # fmt: skip
    step()
    return m.peak_bytes, [p.grad.detach().clone() for p in params]


def _worst(grads, reference) -> float:
    return max(((g - r).abs().max() / r.abs().max()).item() for g, r in zip(grads, reference))


@pytest.mark.parametrize("autocast, tolerance", [(False, 1e-3), (True, 3e-2)])
def test_hcmodule_on_cuda_holds_its_budget_with_plain_gradients(autocast, tolerance):
    workload, batch = _gpt2()
    plain = workload.model.to("cuda")
    naive_peak, reference = _step(plain, batch, list(plain.parameters()), autocast)
    model = copy.deepcopy(plain)
    hc = hbp.HCModule(model, budget=0.5)
    peak, grads = _step(hc, batch, list(model.parameters()), autocast)
    assert peak <= BUDGET_SLACK * 0.5 * naive_peak, (peak, naive_peak, str(hc.plan))
    assert hc.plan.predicted_peak_bytes <= hc.plan.budget_bytes
    assert _worst(grads, reference) <= tolerance


def test_chunked_cross_entropy_on_cuda_matches_the_plain_loss_in_less_memory():
    torch.manual_seed(0)
    tokens, dim, vocab = 2048, 256, 50257
    hidden = torch.randn(tokens, dim, device="cuda", requires_grad=True)
    weight = (0.02 * torch.randn(vocab, dim, device="cuda")).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    results = {}
    for name, loss_fn in {
        "plain": lambda: F.cross_entropy(hidden @ weight.T, target),
        "chunked": lambda: hbp.ops.chunked_cross_entropy(hidden, weight, target),
    }.items():
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = loss_fn()
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        results[name] = (loss.item(), peak, hidden.grad.clone(), weight.grad.clone())
    (loss, peak, gh, gw), (loss_c, peak_c, gh_c, gw_c) = results["plain"], results["chunked"]
    logits_bytes = tokens * vocab * 4
    assert peak >= logits_bytes and peak_c < peak / 2
    assert abs(loss_c - loss) <= 1e-5 * abs(loss)
    assert _worst([gh_c, gw_c], [gh, gw]) <= 1e-3
