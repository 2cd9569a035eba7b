"""Found on real architectures outside the other tests (the zoos of
`experiments/real_models/`), measured by the CPU allocator:

- transformers' attention masks under export: with no `attention_mask` passed, eager SDPA runs
  without a mask (or with `is_causal=True`) while a traced forward used to build the full
  mask, which SDPA saves as a float tensor per layer: HCModule at budget 1.0 measured above
  the plain step (ALBERT +3.6%);
- `hbp.estimate` on a module-level fallback reports the least peak HCModule reaches there
  (the executable plans), not the planner's least plan over the module graph;
- wav2vec2 for CTC is not captured at operator level (xfail: see its reason);
- a convolution whose output gradient comes back transposed (Whisper's conv front end through
  a permute, SD3's patch embedding through a transpose, a flatten and `.to` its own dtype)
  copies it in its backward: the scratch calibration follows the gradient's layout back
  (NOTE [ The layout of an output's gradient ] in hbp/graph/torch/calibrate.py).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import hbp
from hbp.allocator import allocator_peak
from hbp.errors import BudgetError, CaptureWarning

transformers = pytest.importorskip("transformers")


def _albert():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.AlbertConfig(
        vocab_size=256,
        embedding_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
        max_position_embeddings=96,
    )
    return transformers.AlbertForMaskedLM(config).train()


def _step(model, runner, ids, labels):
    model.zero_grad(set_to_none=True)
    runner(input_ids=ids, labels=labels).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_no_attention_mask_passed_runs_without_one_as_eager_does():
    model = _albert()
    ids = torch.randint(0, 256, (4, 96))
    labels = torch.where(torch.rand(ids.shape) < 0.15, ids, torch.full_like(ids, -100))
    plain = copy.deepcopy(model)
    _step(plain, plain, ids, labels)
    expected = _step(plain, plain, ids, labels)
    _, plain_peak = allocator_peak(lambda: _step(plain, plain, ids, labels))

    hc = hbp.HCModule(model, budget=1.0)
    _step(model, hc, ids, labels)  # capture, plan; sees the logits let go
    _step(model, hc, ids, labels)
    _, peak = allocator_peak(lambda: _step(model, hc, ids, labels))
    got = _step(model, hc, ids, labels)

    assert hc.captured.tracer == "export"
    masks = [n for n in hc.captured.graph.nodes if n.op.startswith("scaled_dot_product")]
    assert masks and all(len(n.inputs) == 3 for n in masks)  # q, k, v: no mask
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)
    assert peak <= plain_peak * 1.001, (peak, plain_peak)
    assert abs(hc.plan.predicted_peak_bytes - peak) <= 0.01 * peak


def _qwen3():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
    )
    return transformers.Qwen3ForCausalLM(config).train()


def _lm_step(model, runner, **batch):
    model.zero_grad(set_to_none=True)
    runner(**batch, labels=batch["input_ids"], use_cache=False).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _sdpa_inputs(hc) -> list[int]:
    return [len(n.inputs) for n in hc.captured.graph.nodes if n.op.startswith("scaled_dot")]


def test_causal_lm_without_positions_runs_sdpa_without_a_mask_as_eager_does():
    """No position ids passed: eager's packed-sequence check finds none and SDPA runs causal
    with grouped-query attention in the kernel; a trace used to build the full mask and
    repeat the keys and values per head (Qwen3: 8.4% above the plain step at budget 1.0)."""
    model = _qwen3()
    ids = torch.randint(0, 256, (4, 64))
    plain = copy.deepcopy(model)
    _lm_step(plain, plain, input_ids=ids)
    expected = _lm_step(plain, plain, input_ids=ids)
    _, plain_peak = allocator_peak(lambda: _lm_step(plain, plain, input_ids=ids))

    hc = hbp.HCModule(model, budget=1.0)
    _lm_step(model, hc, input_ids=ids)
    _lm_step(model, hc, input_ids=ids)
    _, peak = allocator_peak(lambda: _lm_step(model, hc, input_ids=ids))
    got = _lm_step(model, hc, input_ids=ids)

    assert _sdpa_inputs(hc) == [3, 3]  # q, k, v: no mask
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name])
    assert peak <= plain_peak * 1.001, (peak, plain_peak)
    assert abs(hc.plan.predicted_peak_bytes - peak) <= 0.01 * peak


def test_packed_position_ids_passed_keep_the_mask():
    """Position ids the caller passes are values the plan cannot depend on: the mask stays,
    and two sequences packed per row attend within their own sequence."""
    model = _qwen3()
    ids = torch.randint(0, 256, (2, 64))
    positions = torch.arange(32).repeat(2).expand(2, -1)  # two sequences of 32 per row
    plain = copy.deepcopy(model)
    expected = _lm_step(plain, plain, input_ids=ids, position_ids=positions)
    hc = hbp.HCModule(model, budget=0.5)
    got = _lm_step(model, hc, input_ids=ids, position_ids=positions)
    assert _sdpa_inputs(hc) == [4, 4]  # q, k, v and the mask
    for name in expected:
        torch.testing.assert_close(got[name], expected[name])


class _DataDependent(nn.Module):
    """Blocks behind a data-dependent branch: no tracer captures it (module-level fallback)."""

    def __init__(self, d=64, n=6):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n)
        )

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        if x.sum() > 0:
            x = x * 2
        return x


def test_estimate_of_a_module_level_fallback_is_what_hcmodule_reaches():
    torch.manual_seed(0)
    model, x = _DataDependent(), torch.randn(256, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CaptureWarning)
        est = hbp.estimate(model, x, budgets=(0.75, "min"))
        hc = hbp.HCModule(model, budget="min")
        hc(x).square().mean().backward()
        assert hc.captured.granularity == "module"
        assert est.granularity == "module"
        assert est.min_peak_bytes == hc.plan.budget_bytes
        below = est.min_peak_bytes - 4096
        with pytest.raises(BudgetError) as info:
            hbp.HCModule(model, budget=below)(x)
    assert info.value.minimum == est.min_peak_bytes
    assert not est.fits(below) and est.fits(est.min_peak_bytes)
    (least,) = [p for p in est.frontier if p.budget == "min"]
    assert least.predicted_peak_bytes == est.min_peak_bytes


@pytest.mark.xfail(
    strict=True,
    reason="Wav2Vec2ForCTC.forward checks `labels.max() >= vocab_size` (a data-dependent "
    "branch non-strict export cannot guard on fake tensors: GuardOnDataDependentSymNode), and "
    "fx cannot trace its `**kwargs` forward (transformers' can_return_tuple wrapper gets None "
    "for kwargs): the capture falls back to module level (min 4.45 MiB where op level would "
    "reach about 3 MiB on the trial's model)",
)
def test_wav2vec2_for_ctc_with_labels_is_captured_at_operator_level():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2,
        mask_time_prob=0.0,
        layerdrop=0.0,
        pad_token_id=0,
    )
    model = transformers.Wav2Vec2ForCTC(config).train()
    hc = hbp.HCModule(model, budget="min")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)
        hc(input_values=torch.randn(2, 2000), labels=torch.randint(1, 32, (2, 10)))
    assert hc.captured.granularity == "op"


class _ConvFrontEnd(nn.Module):
    """Whisper's front end in small: conv, GELU, strided conv, GELU, then a permute to
    (B, T, C) for the linear layers."""

    def __init__(self, mel=16, d=64):
        super().__init__()
        self.conv1 = nn.Conv1d(mel, d, 3, padding=1)
        self.conv2 = nn.Conv1d(d, d, 3, stride=2, padding=1)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        h = nn.functional.gelu(self.conv2(nn.functional.gelu(self.conv1(x))))
        return self.fc(h.permute(0, 2, 1))  # (B, T, C)


class _PatchEmbed(nn.Module):
    """SD3's patch embedding in small: a strided conv, flattened and transposed to (B, HW, C),
    then `.to` its own dtype (which returns the tensor itself) and the linear layers."""

    def __init__(self, c=4, d=64):
        super().__init__()
        self.proj = nn.Conv2d(c, d, 2, stride=2)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        h = self.proj(x).flatten(2).transpose(1, 2).to(x.dtype)
        return self.fc(nn.functional.silu(h))


@pytest.mark.parametrize(
    "build",
    [
        lambda: (_ConvFrontEnd(), torch.randn(4, 16, 1024), torch.randn(4, 512, 64)),
        lambda: (_PatchEmbed(), torch.randn(4, 4, 64, 64), torch.randn(4, 1024, 64)),
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
