"""HCModule holds its budget: the step's peak, measured by the memory tracker or the CPU
allocator, stays within the plan's budget (and near its prediction) for every form of budget
(a fraction, "min", bytes, a size string, above the naive peak), on toy models, GRU and
EmbeddingBag leaves, convolutions whose gradient comes back transposed, and transformers
models whose attention mask the capture must not build when eager does not."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers.compare import (
    assert_within_budget,
    causal_lm_step,
    compare,
    compare_with_plain,
    masked_lm_step,
    minimum_budget,
    sdpa_input_counts,
)
from models.cases import CASE, CASES, images
from models.real import albert_mlm, qwen3_lm
from models.toy import (
    BagMLP,
    CausalAttention,
    ConvFrontEnd,
    GRUHead,
    Mixer,
    PatchEmbed,
    ReducedResidual,
)
from torch import nn

import hbp
from hbp.allocator import allocator_peak
from hbp.errors import BudgetError

# The largest models: their three budgets run in the slow suite.
_SLOW = {"vit", "mobilenetv2", "hf_modeloutput", "causal_buffer"}


def _params() -> list:
    params = []
    for case in CASES:
        for budget in ("1.0", "0.5", "min"):
            marks = [pytest.mark.slow] if case.name in _SLOW else []
            params.append(pytest.param(case.name, budget, id=f"{case.name}-{budget}", marks=marks))
    return params


@pytest.mark.parametrize("name, budget", _params())
def test_same_results_within_the_budget(name, budget):
    """Every toy model at budgets 1.0, 0.5 and the smallest feasible one: the plain model's
    results (outputs, gradients, BatchNorm buffers), the measured peak (MemoryTracker) within
    1.05 x the plan's budget and not far below its prediction, recompute only where the budget
    is tight and at most the predicted FLOPs."""
    case = CASE[name]
    value = minimum_budget(case) if budget == "min" else float(budget)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # checkpoint inlining, forward hooks
        try:
            row = compare_with_plain(case, value)
        except BudgetError as err:  # 0.5 below the minimum: consistent with it
            assert budget == "0.5" and err.minimum == minimum_budget(case) > err.budget
            return
    assert row["granularity"] == "op"
    assert row["peak"] <= 1.05 * row["budget_bytes"], row
    assert row["peak"] >= 0.85 * row["predicted"], row  # the prediction is not far off
    if budget == "1.0":
        assert row["recomputed_segments"] == 0 and row["extra_flops"] == 0, row
        if name != "self_checkpointed":  # (its own checkpointing is replaced by the plan)
            assert row["peak"] <= 1.01 * row["plain_peak"], row
    else:  # tight: recompute really happens, and costs at most what was predicted
        assert row["recomputed_segments"] > 0, row
        assert 0 < row["extra_flops"] <= row["predicted_extra_flops"], row
        if name != "self_checkpointed":
            assert row["peak"] < row["plain_peak"], row


@pytest.mark.parametrize(
    "make_model, make_args",
    [
        (GRUHead, lambda: (torch.randn(8, 20, 32), torch.randn(2, 8, 64, requires_grad=True))),
        (BagMLP, lambda: (torch.randint(0, 1000, (400,)), torch.arange(0, 400, 4))),
    ],
    ids=["gru", "embedding_bag"],
)
def test_gru_and_embedding_bag_at_full_and_minimal_budget(make_model, make_args):
    for budget in (1.0, "min"):
        torch.manual_seed(0)
        hc, plain, got = compare(make_model, make_args(), budget=budget)
        assert hc.captured.granularity == "op"
        assert got.peak_bytes <= 1.05 * hc.plan.budget_bytes


def test_causal_attention_peak_matches_the_prediction():
    """A recomputed segment's trailing unbind/view/permute run their backward before its
    recompute (NOTE [ Recompute at the first unpack ]); predicted below measured otherwise."""
    hc, plain, got = compare(CausalAttention, (torch.randn(4, 64, 64),), budget=0.5)
    assert got.peak_bytes <= 1.02 * hc.plan.predicted_peak_bytes


@pytest.mark.parametrize("budget", ["min", 0.5])
def test_a_forward_ending_in_a_reduction_is_planned_to_the_byte(budget):
    """The last residual value's gradient is the sum's, broadcast: autograd adds the next
    gradient out of place (NOTE [ A broadcast gradient is added out of place ]). Planned as
    an in-place sum before, "min" measured one activation (256 KiB, 23%) over its budget."""
    x, zero = torch.randn(512, 128), torch.zeros(())

    def loss_fn(out, target):
        return out.square().mean()

    torch.manual_seed(0)
    model = ReducedResidual()
    plain = copy.deepcopy(model)
    loss_fn(plain(x), zero).backward()
    hc = hbp.HCModule(model, budget=budget, loss_fn=loss_fn, calibrate=False)
    hc(x, targets=zero).backward()  # capture and plan
    model.zero_grad(set_to_none=True)
    loss, peak = allocator_peak(lambda: hc(x, targets=zero).backward())
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert any(s.recompute for s in hc.plan.segments)
    assert peak <= hc.plan.budget_bytes
    assert abs(peak - hc.plan.predicted_peak_bytes) <= 1024, (peak, hc.plan.predicted_peak_bytes)


def test_a_cls_token_cat_onto_a_transposed_patch_embedding_is_predicted_to_the_byte():
    """A ViT's embedding: conv -> flatten(2).transpose(1, 2) -> cat with a class token. The
    conv's gradient is a strided slice of the cat's, which its backward copies (8 KiB here:
    NOTE [ The layout of an output's gradient ]); measured with a dense gradient before, the
    estimate was that much under the allocator."""

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 64, 8, 8)
            self.cls = nn.Parameter(torch.randn(1, 1, 64))

        def forward(self, x):
            e = self.conv(x).flatten(2).transpose(1, 2)
            return torch.cat((self.cls.expand(len(x), -1, -1), e), dim=1).square().mean()

    torch.manual_seed(0)
    model, x = Embed(), torch.randn(2, 3, 32, 32)
    estimate = hbp.estimate(model, x, budgets=[])
    _, peak = allocator_peak(lambda: model(x).backward())
    assert estimate.naive_peak_bytes == peak


def test_budget_fraction_min_bytes_and_size_strings():
    x = images()
    torch.manual_seed(0)
    hc = hbp.HCModule(Mixer(), budget=0.3, block_size=2, calibrate=False)
    with pytest.raises(BudgetError, match=r"smallest feasible budget is [0-9.]+ MiB") as info:
        hc.prepare(x)
    minimum = info.value.minimum
    assert info.value.budget < minimum
    # a fraction below the least peak names the budgets that always plan
    assert "budget='min' plans for the least peak" in str(info.value)
    assert "'50%act', the default" in str(info.value)
    assert (
        hbp.HCModule(hc.module, budget="min", block_size=2, calibrate=False).prepare(x).budget_bytes
        == minimum
    )
    hc, plain, got = compare(Mixer, (x,), budget=minimum, block_size=2)
    assert_within_budget(hc, got, plain)
    hc, plain, got = compare(Mixer, (x,), budget="2.5MiB", block_size=2)
    assert hc.plan.budget_bytes == int(2.5 * 2**20) and got.peak_bytes <= 2.5 * 2**20


def test_a_byte_budget_above_the_naive_peak_just_runs_plainly():
    """ "64MiB" on a 4 MiB model used to raise ConfigError ("above the naive peak")."""
    for budget in ("64MiB", 10**12):
        hc, plain, got = compare(Mixer, (images(),), budget=budget, block_size=2)
        assert not any(s.recompute for s in hc.plan.segments)
        assert got.peak_bytes == plain.peak_bytes


def test_no_attention_mask_passed_runs_without_one_as_eager_does():
    """transformers' attention masks under a trace (fx's or export's): with no
    `attention_mask` passed, eager SDPA runs without a mask while a traced forward used to
    build the full mask, which SDPA saves as a float tensor per layer (ALBERT at budget 1.0:
    3.6% above the plain step)."""
    pytest.importorskip("transformers")
    model = albert_mlm()
    ids = torch.randint(0, 256, (4, 96))
    labels = torch.where(torch.rand(ids.shape) < 0.15, ids, torch.full_like(ids, -100))
    plain = copy.deepcopy(model)
    masked_lm_step(plain, plain, ids, labels)
    expected = masked_lm_step(plain, plain, ids, labels)
    _, plain_peak = allocator_peak(lambda: masked_lm_step(plain, plain, ids, labels))

    hc = hbp.HCModule(model, budget=1.0)
    masked_lm_step(model, hc, ids, labels)  # capture, plan; sees the logits let go
    masked_lm_step(model, hc, ids, labels)
    _, peak = allocator_peak(lambda: masked_lm_step(model, hc, ids, labels))
    got = masked_lm_step(model, hc, ids, labels)

    masks = [n for n in hc.captured.graph.nodes if n.op.startswith("scaled_dot_product")]
    assert masks and all(len(n.inputs) == 3 for n in masks)  # q, k, v: no mask
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)
    assert peak <= plain_peak * 1.001, (peak, plain_peak)
    assert abs(hc.plan.predicted_peak_bytes - peak) <= 0.01 * peak


def test_causal_lm_without_positions_runs_sdpa_without_a_mask_as_eager_does():
    """No position ids passed: eager's packed-sequence check finds none and SDPA runs causal
    with grouped-query attention in the kernel; a trace used to build the full mask and
    repeat the keys and values per head (Qwen3: 8.4% above the plain step at budget 1.0)."""
    pytest.importorskip("transformers")
    model = qwen3_lm()
    ids = torch.randint(0, 256, (4, 64))
    plain = copy.deepcopy(model)
    causal_lm_step(plain, plain, input_ids=ids)
    expected = causal_lm_step(plain, plain, input_ids=ids)
    _, plain_peak = allocator_peak(lambda: causal_lm_step(plain, plain, input_ids=ids))

    hc = hbp.HCModule(model, budget=1.0)
    causal_lm_step(model, hc, input_ids=ids)
    causal_lm_step(model, hc, input_ids=ids)
    _, peak = allocator_peak(lambda: causal_lm_step(model, hc, input_ids=ids))
    got = causal_lm_step(model, hc, input_ids=ids)

    assert sdpa_input_counts(hc) == [3, 3]  # q, k, v: no mask
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name])
    assert peak <= plain_peak * 1.001, (peak, plain_peak)
    assert abs(hc.plan.predicted_peak_bytes - peak) <= 0.01 * peak


@pytest.mark.parametrize(
    "build",
    [
        lambda: (ConvFrontEnd(), torch.randn(4, 16, 1024), torch.randn(4, 512, 64)),
        lambda: (PatchEmbed(), torch.randn(4, 4, 64, 64), torch.randn(4, 1024, 64)),
    ],
    ids=["permute", "flatten_transpose_to"],
)
def test_conv_whose_gradient_comes_back_transposed_holds_the_budget(build):
    """The conv's gradient comes back through the permute's (or transpose's and flatten's)
    backward transposed, kept so by the elementwise backward after it (and handed on as it is
    by `.to` its own dtype), and convolution_backward copies it contiguous: a copy the size of
    the output over a calibration with the output's own layout (1.100x and 1.127x at "min"
    before NOTE [ The layout of an output's gradient ] followed the layout back)."""
    torch.manual_seed(0)
    model, x, target = build()

    def step(runner):
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(runner(x), target).backward()

    hc = hbp.HCModule(model, budget="min")
    step(hc)
    step(hc)
    _, peak = allocator_peak(lambda: step(hc))
    assert peak <= hc.plan.budget_bytes * 1.01, (peak, hc.plan.budget_bytes)


def test_measured_peak_is_the_current_signatures_own():
    """Each input signature is measured on its first step; `measured_peak_bytes` after a call
    is that call's signature's measurement, not the one of whichever signature was measured
    last (variable-length batches come back to earlier shapes)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.Tanh())])
    hc = hbp.HCModule(model)
    measured = {}
    for rows in (256, 1024, 256, 1024):
        hc(torch.randn(rows, 32)).sum().backward()
        measured.setdefault(rows, hc.measured_peak_bytes)
        assert hc.measured_peak_bytes == measured[rows]
        assert hc.measured_peak_bytes <= hc.plan.budget_bytes
    assert measured[256] < measured[1024]


def test_a_signature_not_yet_measured_reads_no_other_signatures_peak():
    """A new shape's first step run under the caller's own profiler is not measured by hbp:
    `measured_peak_bytes` is then None beside that shape's `budget_bytes`, not the figure of
    the shape measured before it (which read as twice over the budget); a later step of the
    shape is measured and read."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.Tanh())])
    hc = hbp.HCModule(model)
    hc(torch.randn(1024, 32)).sum().backward()
    long_peak = hc.measured_peak_bytes
    assert long_peak is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # hbp's warning that it cannot measure this step
        _, peak = allocator_peak(lambda: hc(torch.randn(256, 32)).sum().backward())
    assert hc.measured_peak_bytes is None
    assert peak <= hc.budget_bytes < long_peak
    hc(torch.randn(256, 32)).sum().backward()
    assert hc.measured_peak_bytes is not None
    assert hc.measured_peak_bytes <= hc.budget_bytes < long_peak


def test_a_byte_budget_a_longer_batch_cannot_meet_names_its_inputs():
    """A byte budget is the same for every input shape: the first step of a longer batch can
    need more. Its BudgetError names that call's input shapes; shorter batches still train."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.Tanh())])
    short, long = torch.randn(64, 32), torch.randn(4096, 32)
    with pytest.raises(BudgetError) as least:
        hbp.HCModule(copy.deepcopy(model), budget=1)(long).sum().backward()
    hc = hbp.HCModule(model, budget=least.value.minimum - 1)
    hc(short).sum().backward()
    with pytest.raises(BudgetError, match=r"at this call's inputs \(args\[0\] 4096x32\)") as err:
        hc(long).sum().backward()
    assert err.value.minimum == least.value.minimum
    hc(short).sum().backward()
    hc.budget = 1000  # bytes, too few for the short batch too, which is not a new signature
    with pytest.raises(BudgetError) as err:
        hc(short).sum().backward()
    assert "new input signature" not in str(err.value)


class WritesIntoSlices(nn.Module):
    """A recurrence whose steps are written into slices of a buffer made in forward
    (`out[:, t] = ...`, as transformers' RWKV does on CPU): later ops read the buffer, not the
    writes, so only the base carries the gradient back to them."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        out = torch.zeros_like(x)
        state = torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            state = torch.tanh(self.lin(x[:, t]) + state)
            out[:, t] = torch.sigmoid(state)
        return out.square().mean()


def test_writes_into_a_views_base_are_planned_with_their_backward():
    """NOTE [ A write into a view reaches backward through its base ]: the values written
    were counted as having no backward, so nothing they save was predicted (RWKV: a third of
    the step under the allocator, and a budget missed by 27%)."""
    torch.manual_seed(0)
    model, x = WritesIntoSlices(), torch.randn(4, 12, 32)
    estimate = hbp.estimate(model, x, budgets=[])
    assert estimate.granularity == "op"
    _, peak = allocator_peak(lambda: model(x).backward())
    assert estimate.naive_peak_bytes == peak
    hc, plain, got = compare(WritesIntoSlices, (x,), budget=0.8)
    assert_within_budget(hc, got, plain)


def _gpt2_least_peak(through_loss_fn: bool) -> tuple[int, int, int]:
    """(predicted, budget, allocator-measured) bytes of GPT-2 small at "min", its loss its
    own forward's, or handed back through `loss_fn=`."""
    from hbp.workloads import build

    torch.manual_seed(0)
    wl = build("gpt2", "small", seed=0)
    batch = wl.make_batch(0)
    if through_loss_fn:
        hc = hbp.HCModule(wl.model, "min", loss_fn=lambda out, _: wl.loss_fn(out, batch))
        kwargs = {"targets": torch.zeros(1)}
    else:
        hc = hbp.HCModule(wl.model, "min")
        kwargs = {}

    def step():
        hc(*batch.args, **kwargs).backward()

    step()
    wl.model.zero_grad(set_to_none=True)
    measured = allocator_peak(step)[1]
    return hc.plan.predicted_peak_bytes, hc.budget_bytes, measured


def test_the_loss_wrapper_reaches_the_least_peak_of_the_model_that_ends_at_its_loss():
    """NOTE [ A trailing run of the inputs' views ]: GPT-2 (its loss in its own forward)
    captured through `loss_fn=` ends with views of the targets after the loss (`hbp.estimate`'s,
    with a slice of its arguments); cuts among them hid the cut before the loss, and "min"
    reached 24.5 MiB through the wrapper, 24.0 without it. All reach the same least peak now,
    and the allocator measures it."""
    own, wrapped = _gpt2_least_peak(False), _gpt2_least_peak(True)
    assert wrapped[0] == own[0], (wrapped, own)
    from hbp.workloads import build

    wl = build("gpt2", "small", seed=0)
    batch = wl.make_batch(0)  # hbp.estimate's wrapper ends with a slice of its arguments
    estimate = hbp.estimate(wl.model, *batch.args, loss_fn=lambda out: out, budgets=["min"])
    assert estimate.min_peak_bytes == own[0], (estimate.min_peak_bytes, own)
    for _, budget, measured in (own, wrapped):
        assert measured <= budget + 64, (measured, budget)
