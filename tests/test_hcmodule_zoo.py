"""hbp.HCModule used as a new user would, on models written here from scratch (none of them
is one of hbp's workloads): a small ViT with nn.MultiheadAttention, a MobileNetV2-like net,
an LSTM/GRU tagger, a HuggingFace-style block with `attention_mask=` and a ModelOutput /
dataclass result, a causal-mask buffer sliced by the sequence length, a frozen backbone, a
model that calls torch.utils.checkpoint itself, weights tied across non-adjacent layers,
bfloat16 autocast (around the call, and no_grad/autocast regions inside the forward),
integer/boolean inputs, and inputs that are lists or dicts of tensors.

For each model and budget (1.0, 0.5, the smallest feasible one): outputs and parameter
gradients equal the plain model's (same seed), the measured peak (MemoryTracker) is within
1.05 x the plan's budget, recomputation happens where the budget is tight, and BatchNorm
buffers equal those of one plain step."""

from __future__ import annotations

import copy
import dataclasses
import functools
import io
import math
import pickle
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from helpers.step import Case, assert_same_step, leaves, train_step  # noqa: F401
from torch import nn
from torch.utils.checkpoint import checkpoint

import hbp
from hbp.errors import BudgetError, CaptureWarning

# ---------------------------------------------------------------------------------------
# The zoo
# ---------------------------------------------------------------------------------------


class ViTBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * dim, dim)
        )

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyViT(nn.Module):
    """Patch-embedding conv, cls token, learned position embedding, MHA blocks."""

    def __init__(self, image=32, patch=4, dim=64, depth=4, heads=4, classes=10):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class InvertedResidual(nn.Module):
    def __init__(self, cin, cout, stride, expand):
        super().__init__()
        hidden = cin * expand
        self.residual = stride == 1 and cin == cout
        self.conv = nn.Sequential(
            nn.Conv2d(cin, hidden, 1, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),  # depthwise
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )

    def forward(self, x):
        return x + self.conv(x) if self.residual else self.conv(x)


class TinyMobileNetV2(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        layers = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(True)]
        for cin, cout, stride in [(16, 16, 1), (16, 24, 2), (24, 24, 1), (24, 32, 2), (32, 32, 1)]:
            layers.append(InvertedResidual(cin, cout, stride, expand=4))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(32, classes))

    def forward(self, x):
        return self.classifier(F.adaptive_avg_pool2d(self.features(x), 1).flatten(1))


class RNNTagger(nn.Module):
    """Embedding -> LSTM (a leaf returning (output, (h, c))) -> GRU -> per-token logits."""

    def __init__(self, vocab=100, dim=32, hidden=48, tags=7):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, hidden, num_layers=2, batch_first=True, dropout=0.1)
        self.gru = nn.GRU(hidden, hidden, batch_first=True, bidirectional=True)
        self.proj = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.Tanh())
        self.out = nn.Linear(hidden, tags)

    def forward(self, tokens):
        seq, (h, c) = self.lstm(self.emb(tokens))
        seq, _ = self.gru(seq)
        return self.out(self.proj(seq)), h[-1] + c[-1]


class ModelOutput(OrderedDict):
    """transformers.utils.ModelOutput in miniature: a dict that also has attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclasses.dataclass
class LMOutput:
    loss: torch.Tensor
    logits: torch.Tensor
    hidden_states: tuple
    num_layers: int = 0
    note: str = ""


class HFAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.dropout = nn.Dropout(0.1)

    def forward(self, hidden_states, attention_mask=None):
        b, t, d = hidden_states.size()

        def split(x):
            return x.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = (
            split(self.q(hidden_states)),
            split(self.k(hidden_states)),
            split(self.v(hidden_states)),
        )
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = self.dropout(scores.softmax(-1))
        return self.o((probs @ v).transpose(1, 2).reshape(b, t, d))


class HFLayer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attention = HFAttention(dim, heads)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, hidden_states, attention_mask=None):
        hidden_states = self.ln1(hidden_states + self.attention(hidden_states, attention_mask))
        return self.ln2(hidden_states + self.ffn(hidden_states))


class HFStyleLM(nn.Module):
    """BERT-like: token + position embeddings, additive extended attention mask from a 0/1
    `attention_mask`, optional labels, ModelOutput or dataclass result with non-tensors."""

    def __init__(self, vocab=120, dim=48, heads=4, depth=3, max_len=64, dataclass_output=False):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.layers = nn.ModuleList(HFLayer(dim, heads) for _ in range(depth))
        self.lm_head = nn.Linear(dim, vocab)
        self.dataclass_output = dataclass_output

    def forward(
        self,
        input_ids,
        attention_mask=None,
        labels=None,
        output_hidden_states=False,
        return_dict=True,
        **kwargs,
    ):
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device)
        h = self.tok(input_ids) + self.pos(positions)[None]
        extended = None
        if attention_mask is not None:
            extended = (1.0 - attention_mask[:, None, None, :].to(h.dtype)) * torch.finfo(
                h.dtype
            ).min
        states = (h,)
        for layer in self.layers:
            h = layer(h, attention_mask=extended)
            states = states + (h,)
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100
            )
        if not return_dict:
            return (loss, logits) if loss is not None else (logits,)
        hidden = states if output_hidden_states else ()
        if self.dataclass_output:
            return LMOutput(loss, logits, hidden, num_layers=len(self.layers), note="ok")
        return ModelOutput(loss=loss, logits=logits, hidden_states=hidden)


class CausalSelfAttention(nn.Module):
    """nanoGPT's non-flash path: a registered tril buffer sliced by the sequence length."""

    def __init__(self, dim, heads, block_size):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.register_buffer(
            "bias",
            torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size),
        )

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MaskedGPT(nn.Module):
    def __init__(self, vocab=96, dim=48, heads=4, depth=3, block_size=64):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block_size, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {"ln": nn.LayerNorm(dim), "attn": CausalSelfAttention(dim, heads, block_size)}
            )
            for _ in range(depth)
        )
        self.mlps = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
            )
            for _ in range(depth)
        )
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        t = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block, mlp in zip(self.blocks, self.mlps):
            x = x + block["attn"](block["ln"](x))
            x = x + mlp(x)
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class FrozenBackbone(nn.Module):
    """A pretrained-style frozen feature extractor (requires_grad False) + trainable head."""

    def __init__(self, dim=64, depth=6, classes=5):
        super().__init__()
        self.backbone = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(dim, dim), nn.LayerNorm(dim), nn.GELU())
                for _ in range(depth)
            ]
        )
        self.backbone.requires_grad_(False)
        self.head = nn.Sequential(
            nn.Linear(dim, 2 * dim),
            nn.GELU(),
            nn.Linear(2 * dim, 2 * dim),
            nn.GELU(),
            nn.Linear(2 * dim, classes),
        )

    def forward(self, x):
        return self.head(self.backbone(x))


class SelfCheckpointed(nn.Module):
    """A model that already checkpoints its own blocks with torch.utils.checkpoint."""

    def __init__(self, dim=64, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * dim, dim)
            )
            for _ in range(depth)
        )
        self.head = nn.Linear(dim, dim)

    def forward(self, x):
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)
        return self.head(x)


class TiedAcross(nn.Module):
    """One Linear module reused at layers 1 and 4, and a weight shared by layers 0 and 5."""

    def __init__(self, dim=64):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(6))
        self.layers[4] = self.layers[1]
        self.layers[5].weight = self.layers[0].weight

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class MLPNet(nn.Module):
    def __init__(self, dim=64, depth=6):
        super().__init__()
        self.layers = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                for _ in range(depth)
            ]
        )

    def forward(self, x):
        return self.layers(x)


class ListInput(nn.Module):
    """forward(xs: list of tensors) and forward(batch: dict of tensors)."""

    def __init__(self, dim=64, depth=4):
        super().__init__()
        self.a = MLPNet(dim, depth)
        self.b = MLPNet(dim, depth)

    def forward(self, xs):
        return self.a(xs[0]) * torch.sigmoid(self.b(xs[1]))


class DictInput(ListInput):
    def forward(self, batch):
        h = self.a(batch["x"]) + self.b(batch["y"])
        return {"h": h, "masked": h.masked_fill(~batch["keep"], 0.0)}


class Distill(nn.Module):
    """A frozen teacher run under `torch.no_grad()` and a student body under bfloat16
    autocast, both inside the forward (fx records ops, not context managers)."""

    def __init__(self, dim=64):
        super().__init__()
        self.teacher = MLPNet(dim, 3)
        self.body = MLPNet(dim, 4)
        self.head = nn.Linear(dim, dim)

    def forward(self, x):
        with torch.no_grad():
            target = self.teacher(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.body(x)
        out = self.head(h.float())
        return F.mse_loss(out, target), h.dtype


class DataDependentNet(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.pre = nn.Linear(dim, dim)
        self.body = MLPNet(dim, 4).layers  # an nn.Sequential: its children are cut points

    def forward(self, x):
        h = self.pre(x)
        if h.sum() > 0:  # data-dependent control flow
            h = -h
        return self.body(h)


# ---------------------------------------------------------------------------------------
# Cases: a model, its inputs, how exactly results must match
# ---------------------------------------------------------------------------------------


def tokens(b, t, vocab):
    return torch.randint(0, vocab, (b, t))


def hf_inputs():
    ids = tokens(4, 32, 120)
    mask = torch.ones(4, 32, dtype=torch.long)
    mask[1, 20:] = 0
    mask[3, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return (ids,), {"attention_mask": mask, "labels": labels, "output_hidden_states": True}


def dict_inputs():
    x, y = torch.randn(256, 64), torch.randn(256, 64, requires_grad=True)
    return ({"x": x, "y": y, "keep": torch.rand(256, 64) > 0.5},), {}


CASES = [
    Case("vit", TinyViT, lambda: ((torch.randn(8, 3, 32, 32),), {}), block_size=2),
    Case("mobilenetv2", TinyMobileNetV2, lambda: ((torch.randn(8, 3, 32, 32),), {}), block_size=2),
    Case("lstm_gru", RNNTagger, lambda: ((tokens(8, 24, 100),), {})),
    Case("hf_modeloutput", HFStyleLM, hf_inputs, block_size=4, own_loss=True),
    Case(
        "hf_dataclass",
        lambda: HFStyleLM(dataclass_output=True),
        hf_inputs,
        block_size=4,
        own_loss=True,
    ),
    Case(
        "causal_buffer",
        MaskedGPT,
        lambda: ((tokens(4, 40, 96), tokens(4, 40, 96)), {}),
        block_size=4,
    ),
    Case("frozen_backbone", FrozenBackbone, lambda: ((torch.randn(512, 64),), {})),
    Case(
        "self_checkpointed",
        SelfCheckpointed,
        lambda: ((torch.randn(512, 64, requires_grad=True),), {}),
    ),
    Case("tied_across", TiedAcross, lambda: ((torch.randn(512, 64, requires_grad=True),), {})),
    Case("autocast_bf16", MLPNet, lambda: ((torch.randn(512, 64),), {}), autocast=True),
    Case("list_input", ListInput, lambda: (([torch.randn(256, 64), torch.randn(256, 64)],), {})),
    Case("dict_input", DictInput, dict_inputs),
    Case("no_grad_autocast_inside", Distill, lambda: ((torch.randn(512, 64),), {})),
]
CASE = {case.name: case for case in CASES}


# ---------------------------------------------------------------------------------------
# Harness
# ---------------------------------------------------------------------------------------


@functools.cache
def minimum_budget(name: str) -> int:
    """The smallest feasible budget in bytes, from the BudgetError of a 1-byte budget."""
    case = CASE[name]
    torch.manual_seed(0)
    model, (args, kwargs) = case.make_model(), case.make_inputs()
    hc = hbp.HCModule(model, budget=1, block_size=case.block_size)
    with pytest.raises(BudgetError, match=r"smallest feasible budget is [0-9.]+ MiB") as info:
        with case.autocast_context(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            hc.prepare(*args, **kwargs)
    assert info.value.budget == 1 and info.value.minimum > 1
    return info.value.minimum


def compare_with_plain(case: Case, budget) -> dict:
    """Plain model vs HCModule(budget) on fresh copies with the same weights, inputs and
    seed: assert the same results; return a row of measurements."""
    torch.manual_seed(0)
    model = case.make_model()
    reference = copy.deepcopy(model)
    args, kwargs = case.make_inputs()
    ref_args, ref_kwargs = copy.deepcopy((args, kwargs))
    keep = not case.own_loss
    expected = train_step(reference, reference, case, ref_args, ref_kwargs, keep_outputs=keep)
    hc = hbp.HCModule(model, budget=budget, block_size=case.block_size)
    got = train_step(hc, model, case, args, kwargs, keep_outputs=keep)
    assert_same_step(expected, got, case.exact)
    plan = hc.plan
    return dict(
        model=case.name,
        budget=budget,
        granularity=hc.captured.granularity,
        plain_peak=expected.peak_bytes,
        peak=got.peak_bytes,
        budget_bytes=plan.budget_bytes,
        predicted=plan.predicted_peak_bytes,
        recomputed_segments=sum(s.recompute for s in plan.segments),
        # FLOPs run on top of one forward and one backward of the captured graph
        extra_flops=got.flops - plan.naive_flops,
        predicted_extra_flops=plan.predicted_recompute_flops,
        plain_flops=expected.flops,
    )


# ---------------------------------------------------------------------------------------
# Every model at budgets 1.0, 0.5 and the smallest feasible one
# ---------------------------------------------------------------------------------------

_SLOW = {"vit", "mobilenetv2", "hf_modeloutput", "causal_buffer"}


def _params() -> list:
    params = []
    for case in CASES:
        for budget in ("1.0", "0.5", "min"):
            marks = [pytest.mark.slow] if case.name in _SLOW else []
            params.append(pytest.param(case.name, budget, id=f"{case.name}-{budget}", marks=marks))
    return params


@pytest.mark.parametrize("name, budget", _params())
def test_zoo_model_same_results_within_budget(name, budget):
    case = CASE[name]
    value = minimum_budget(name) if budget == "min" else float(budget)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # checkpoint inlining, forward hooks
        try:
            row = compare_with_plain(case, value)
        except BudgetError as err:  # 0.5 below the minimum: consistent with it
            assert budget == "0.5" and err.minimum == minimum_budget(name) > err.budget
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


# ---------------------------------------------------------------------------------------
# The wrapper as a module: modes, dtype, state dicts, pickling, repeated steps, shapes
# ---------------------------------------------------------------------------------------


def test_eval_no_grad_train_to_state_dict_and_print(count_captures):
    torch.manual_seed(0)
    model = TinyMobileNetV2()
    reference = copy.deepcopy(model)
    hc = hbp.HCModule(model, budget=0.5, block_size=2)
    captures = count_captures()
    x = torch.randn(4, 3, 32, 32)
    hc.eval()
    assert not model.training and not any(m.training for m in model.modules())
    reference.eval()
    assert torch.equal(hc(x), reference(x))  # eval: the module just runs
    hc.train()
    assert model.training
    reference.train()
    with torch.no_grad():
        torch.manual_seed(1)
        out = hc(x)
        torch.manual_seed(1)
        assert torch.equal(out, reference(x))  # no_grad: just runs (BatchNorm updates)
    assert captures == []
    assert hc.plan is None and "not planned yet" in hc.summary()

    case = Case("mobilenetv2", TinyMobileNetV2, lambda: ((x,), {}))
    got = train_step(hc, model, case, (x,), {})
    expected = train_step(reference, reference, case, (x,), {})
    assert_same_step(expected, got)
    assert captures == [1]
    text = str(hc.plan)
    assert "predicted peak" in text and "recompute" in text
    assert hc.summary().startswith("HCModule: op-level capture") and text in hc.summary()
    assert "budget=0.5" in repr(hc)

    # .to() keeps the Parameter objects but changes their dtype: planned again, in float64
    hc.to(torch.float64)
    reference.to(torch.float64)
    got = train_step(hc, model, case, (x.double(),), {})
    expected = train_step(reference, reference, case, (x.double(),), {})
    assert_same_step(expected, got)
    assert captures == [1, 1]
    assert got.peak_bytes <= 1.05 * hc.plan.budget_bytes

    # state dicts: the plain model's keys, loaded both ways (with the "module." prefix too)
    plain = TinyMobileNetV2().double()
    assert set(hc.state_dict()) == set(plain.state_dict())
    plain.load_state_dict(hc.state_dict())
    for a, b in zip(plain.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    fresh = TinyMobileNetV2().double()
    hc.load_state_dict(fresh.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    hc.load_state_dict(plain.state_dict())
    hc.load_state_dict({f"module.{k}": v for k, v in plain.state_dict().items()})
    with pytest.raises(RuntimeError, match="Missing key"):
        hc.load_state_dict({"module.classifier.1.bias": plain.classifier[1].bias}, strict=True)


def test_torch_save_pickle_and_deepcopy_round_trip():
    torch.manual_seed(0)
    case = CASE["hf_modeloutput"]
    model = case.make_model()
    args, kwargs = case.make_inputs()
    hc = hbp.HCModule(model, budget=0.5, block_size=4)
    expected = train_step(hc, model, case, args, kwargs)
    buffer = io.BytesIO()
    torch.save(hc, buffer)
    buffer.seek(0)
    copies = [
        torch.load(buffer, weights_only=False),
        pickle.loads(pickle.dumps(hc)),
        copy.deepcopy(hc),
    ]
    for clone in copies:
        assert isinstance(clone, hbp.HCModule) and clone.plan is None  # plans are rebuilt
        assert clone.budget == 0.5 and clone.block_size == 4
        got = train_step(clone, clone.module, case, args, kwargs)
        assert_same_step(expected, got)
        assert clone.plan.budget_bytes == hc.plan.budget_bytes


def test_repeated_optimizer_steps_match_the_plain_model(count_captures):
    """Three SGD steps with dropout and BatchNorm: same weights and running statistics after
    every step; one capture for the three."""
    torch.manual_seed(0)
    model = TinyMobileNetV2()
    reference = copy.deepcopy(model)
    hc = hbp.HCModule(model, budget=minimum_budget("mobilenetv2"), block_size=2)
    captures = count_captures()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    target = torch.randint(0, 10, (8,))
    for step in range(3):
        x = torch.randn(8, 3, 32, 32)
        for module, optimizer in ((hc, opt), (reference, ref_opt)):
            optimizer.zero_grad()
            torch.manual_seed(step)
            F.cross_entropy(module(x), target).backward()
            optimizer.step()
        for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {step}: {name}")
    assert captures == [1]
    assert model.features[1].num_batches_tracked.item() == 3


def test_a_new_batch_size_is_planned_again(count_captures):
    torch.manual_seed(0)
    case = CASE["causal_buffer"]
    model = case.make_model()
    reference = copy.deepcopy(model)
    hc = hbp.HCModule(model, budget=0.7, block_size=4)
    captures = count_captures()
    budgets = []
    for batch, seq in ((4, 40), (2, 40), (2, 24), (4, 40)):
        args = (tokens(batch, seq, 96), tokens(batch, seq, 96))
        got = train_step(hc, model, case, args, {})
        assert_same_step(train_step(reference, reference, case, args, {}), got)
        assert got.peak_bytes <= 1.05 * hc.plan.budget_bytes
        budgets.append(hc.plan.budget_bytes)
    assert len(captures) == 3  # the last shape was planned already
    assert budgets[0] > budgets[1] > budgets[2] and budgets[3] == budgets[0]


def test_autocast_is_part_of_the_input_signature(count_captures):
    torch.manual_seed(0)
    model = MLPNet()
    captures = count_captures()
    hc = hbp.HCModule(model, budget=0.5)
    x = torch.randn(512, 64)
    hc(x).sum().backward()
    float32 = hc.plan
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = hc(x)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and len(captures) == 2
    assert hc.plan.naive_peak_bytes < 0.7 * float32.naive_peak_bytes  # half-size activations


# ---------------------------------------------------------------------------------------
# Outputs, the model's own checkpointing, untraceable models, infeasible budgets
# ---------------------------------------------------------------------------------------


class Containers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        return [h, {"relu": h.relu(), "n": 3}], OrderedDict(a=h.sum()), x.shape[0]


def test_outputs_keep_the_modules_own_container_types():
    torch.manual_seed(0)
    case = CASE["hf_modeloutput"]
    args, kwargs = case.make_inputs()
    for dataclass_output in (False, True):
        model = HFStyleLM(dataclass_output=dataclass_output)
        hc = hbp.HCModule(model, budget=0.6, block_size=4)
        out, expected = hc(*args, **kwargs), model(*args, **kwargs)
        assert type(out) is type(expected)
        assert out.loss.requires_grad and len(out.hidden_states) == 4  # attribute access
        if dataclass_output:
            assert (out.num_layers, out.note) == (3, "ok")
        else:
            assert list(out) == ["loss", "logits", "hidden_states"]
        out.loss.backward()
    hc = hbp.HCModule(Containers(), budget=1.0)
    out = hc(torch.randn(4, 16, requires_grad=True))
    assert type(out) is tuple and type(out[0]) is list and type(out[0][1]) is dict
    assert type(out[1]) is OrderedDict and out[2] == 4 and out[0][1]["n"] == 3
    out[0].append("mutable")  # a real list, not fx's immutable_list
    out[0][1]["new"] = 1


def test_a_model_that_checkpoints_itself_is_planned_as_a_whole():
    """Its torch.utils.checkpoint calls are traced through, with a warning; with the plain
    model's own peak as the budget, HCModule fits it with less recompute."""
    torch.manual_seed(0)
    case = CASE["self_checkpointed"]
    model = case.make_model()
    reference = copy.deepcopy(model)
    (x,), _ = case.make_inputs()
    inputs = (x.detach().requires_grad_(),)
    expected = train_step(reference, reference, case, inputs, {}, keep_outputs=True)
    hc = hbp.HCModule(model, budget=expected.peak_bytes)
    with pytest.warns(UserWarning, match=r"calls torch.utils.checkpoint \(4x\); HCModule traces"):
        got = train_step(hc, model, case, (x,), {}, keep_outputs=True)
    assert_same_step(expected, got)
    assert got.peak_bytes <= expected.peak_bytes
    assert got.flops <= expected.flops


def test_data_dependent_control_flow_falls_back_to_module_calls_with_a_warning():
    torch.manual_seed(0)
    model = DataDependentNet()
    reference = copy.deepcopy(model)
    x = torch.randn(512, 64, requires_grad=True)
    case = Case("data_dependent", DataDependentNet, None)
    expected = train_step(reference, reference, case, (x,), {})
    hc = hbp.HCModule(model, budget="min")
    with pytest.warns(CaptureWarning, match=r"could not capture DataDependentNet .*module-level"):
        got = train_step(hc, model, case, (x,), {})
    assert hc.captured.granularity == "module"
    assert "fell back" in hc.summary() or "op-level capture failed" in hc.summary()
    assert_same_step(expected, got)
    assert any(s.recompute for s in hc.plan.segments)  # child calls are recomputed
    # (each stops before its matmul: NOTE [ Early stop at the last pack ])
    assert got.flops <= expected.flops + hc.plan.predicted_recompute_flops
    assert got.peak_bytes < expected.peak_bytes
    # "min" is the plan that runs: its prediction bounds what was measured, and a budget below
    # it is refused with it as the minimum. Known gap: this plan (GELU and Linear calls
    # checkpointed alone, each recompute stopping before its matmul) measured 2261256 B for a
    # predicted 2392320 B (5.8% over: one Linear output); not analysed yet.
    assert got.peak_bytes <= 1.02 * hc.plan.predicted_peak_bytes
    with pytest.raises(BudgetError) as info:
        hbp.HCModule(model, budget=hc.plan.predicted_peak_bytes - 4096)(x)
    assert info.value.minimum == hc.plan.predicted_peak_bytes


def test_infeasible_budget_raises_budget_error_with_the_minimum():
    name = "tied_across"
    minimum = minimum_budget(name)
    case = CASE[name]
    hc = hbp.HCModule(case.make_model(), budget=minimum - 4096)
    with pytest.raises(BudgetError, match="MiB") as info:
        hc(*case.make_inputs()[0])
    assert info.value.minimum == minimum and info.value.budget == minimum - 4096
    row = compare_with_plain(case, minimum)  # and the minimum itself fits
    assert row["peak"] <= 1.05 * minimum
    hc = hbp.HCModule(case.make_model(), budget="min")
    assert hc.prepare(*case.make_inputs()[0]).budget_bytes == minimum
    with pytest.raises(hbp.ConfigError, match="budget"):
        hbp.HCModule(case.make_model(), budget=1.5)
