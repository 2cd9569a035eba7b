"""hbp.HCModule used as a new user would, on models written here from scratch (none of them
is one of hbp's workloads): a small ViT with nn.MultiheadAttention, a MobileNetV2-like net,
an LSTM/GRU tagger, a HuggingFace-style block with `attention_mask=` and a ModelOutput /
dataclass result, a causal-mask buffer sliced by the sequence length, a frozen backbone, a
model that calls torch.utils.checkpoint itself, weights tied across non-adjacent layers,
bfloat16 autocast, integer/boolean inputs, and inputs that are lists or dicts of tensors.

For each model and budget (1.0, 0.5, the smallest feasible one): outputs and parameter
gradients equal the plain model's (same seed), the measured peak (MemoryTracker) is within
1.05 x the plan's budget, recomputation happens where the budget is tight, and BatchNorm
buffers equal those of one plain step."""

from __future__ import annotations

import copy
import dataclasses
import io
import math
import pickle
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

import hbp
from hbp.errors import BudgetError, CaptureWarning
from hbp.runtime.flops import TotalFlopCounterMode
from hbp.runtime.tracker import MemoryTracker

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

        q, k, v = split(self.q(hidden_states)), split(self.k(hidden_states)), split(self.v(hidden_states))
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
        self, input_ids, attention_mask=None, labels=None, output_hidden_states=False, return_dict=True
    ):
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device)
        h = self.tok(input_ids) + self.pos(positions)[None]
        extended = None
        if attention_mask is not None:
            extended = (1.0 - attention_mask[:, None, None, :].to(h.dtype)) * torch.finfo(h.dtype).min
        states = (h,)
        for layer in self.layers:
            h = layer(h, attention_mask=extended)
            states = states + (h,)
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
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
            "bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
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
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
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
            *[nn.Sequential(nn.Linear(dim, dim), nn.LayerNorm(dim), nn.GELU()) for _ in range(depth)]
        )
        self.backbone.requires_grad_(False)
        self.head = nn.Sequential(
            nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, classes)
        )

    def forward(self, x):
        return self.head(self.backbone(x))


class SelfCheckpointed(nn.Module):
    """A model that already checkpoints its own blocks with torch.utils.checkpoint."""

    def __init__(self, dim=64, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * dim, dim))
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
            *[nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)) for _ in range(depth)]
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


class DataDependentNet(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.pre = nn.Linear(dim, dim)
        self.body = MLPNet(dim, 4)

    def forward(self, x):
        h = self.pre(x)
        if h.sum() > 0:  # data-dependent control flow
            h = -h
        return self.body(h)


# ---------------------------------------------------------------------------------------
# Cases: a model factory, an input factory and how exactly results must match
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    name: str
    make_model: object  # () -> nn.Module
    make_inputs: object  # () -> (args tuple, kwargs dict)
    exact: bool = True  # bitwise equal outputs and gradients
    autocast: bool = False  # run under torch.autocast("cpu", torch.bfloat16)


def _tokens(b, t, vocab):
    return torch.randint(0, vocab, (b, t))


def _hf_inputs():
    ids = _tokens(4, 32, 120)
    mask = torch.ones(4, 32, dtype=torch.long)
    mask[1, 20:] = 0
    mask[3, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return (ids,), {"attention_mask": mask, "labels": labels, "output_hidden_states": True}


def _dict_inputs():
    x, y = torch.randn(64, 64), torch.randn(64, 64, requires_grad=True)
    return ({"x": x, "y": y, "keep": torch.rand(64, 64) > 0.5},), {}


CASES = [
    Case("vit", TinyViT, lambda: ((torch.randn(8, 3, 32, 32),), {})),
    Case("mobilenetv2", TinyMobileNetV2, lambda: ((torch.randn(8, 3, 32, 32),), {})),
    Case("lstm_gru", RNNTagger, lambda: ((_tokens(8, 24, 100),), {})),
    Case("hf_modeloutput", HFStyleLM, _hf_inputs),
    Case("hf_dataclass", lambda: HFStyleLM(dataclass_output=True), _hf_inputs),
    Case("causal_buffer", MaskedGPT, lambda: ((_tokens(4, 40, 96), _tokens(4, 40, 96)), {})),
    Case("frozen_backbone", FrozenBackbone, lambda: ((torch.randn(128, 64),), {})),
    Case("self_checkpointed", SelfCheckpointed, lambda: ((torch.randn(128, 64, requires_grad=True),), {})),
    Case("tied_across", TiedAcross, lambda: ((torch.randn(128, 64, requires_grad=True),), {})),
    Case("autocast_bf16", MLPNet, lambda: ((torch.randn(128, 64),), {}), autocast=True),
    Case("list_input", ListInput, lambda: (([torch.randn(64, 64), torch.randn(64, 64)],), {})),
    Case("dict_input", DictInput, _dict_inputs),
]


# ---------------------------------------------------------------------------------------
# Harness
# ---------------------------------------------------------------------------------------


def leaves(value):
    """Tensor leaves of nested tuples/lists/dicts and dataclasses."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in leaves(v)]
    return [value] if isinstance(value, torch.Tensor) else []


@dataclasses.dataclass
class StepResult:
    outputs: list
    grads: dict
    buffers: dict
    peak_bytes: int
    flops: int


def train_step(module, model, case, args, kwargs, seed=0) -> StepResult:
    """One step of `module` (`model` or its wrapper): loss = sum of every float output."""
    for p in model.parameters():
        p.grad = None
    for t in leaves((args, kwargs)):
        t.grad = None
    torch.manual_seed(seed)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.autocast)
    with MemoryTracker(record_timeline=False) as tracker, TotalFlopCounterMode() as counter:
        with autocast:
            out = module(*args, **kwargs)
        loss = sum(t.float().sum() for t in leaves(out) if t.requires_grad)
        loss.backward()
        del loss
    grads = {n: p.grad for n, p in model.named_parameters()}
    grads.update({f"input{i}": t.grad for i, t in enumerate(leaves((args, kwargs))) if t.requires_grad})
    return StepResult(
        [t.detach() for t in leaves(out)],
        grads,
        {n: b.clone() for n, b in model.named_buffers()},
        tracker.peak_bytes,
        int(counter.get_total_flops()),
    )


def assert_close(a, b, exact, what):
    if exact:
        assert torch.equal(a, b), what
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=what)


def assert_same_step(expected: StepResult, got: StepResult, exact: bool):
    assert len(expected.outputs) == len(got.outputs)
    for i, (a, b) in enumerate(zip(expected.outputs, got.outputs)):
        assert_close(a, b, exact, f"output {i}")
    assert expected.grads.keys() == got.grads.keys()
    for name, a in expected.grads.items():
        b = got.grads[name]
        assert (a is None) == (b is None), name
        if a is not None:
            assert_close(a, b, exact, f"grad of {name}")
    for name, a in expected.buffers.items():
        assert torch.equal(a, got.buffers[name]), f"buffer {name}"


def minimum_budget(case) -> int:
    """The smallest feasible budget in bytes, from the BudgetError of a 1-byte budget."""
    args, kwargs = case.make_inputs()
    hc = hbp.HCModule(case.make_model(), budget=1)
    with pytest.raises(BudgetError, match="MiB") as info:
        hc.prepare(*args, **kwargs)
    assert info.value.minimum > 1
    return info.value.minimum


def check_case(case, budget, seed=0):
    """Plain vs HCModule at `budget` on fresh copies; returns a table row."""
    torch.manual_seed(seed)
    model = case.make_model()
    reference = copy.deepcopy(model)
    args, kwargs = case.make_inputs()
    ref_args, ref_kwargs = copy.deepcopy((args, kwargs))
    expected = train_step(reference, reference, case, ref_args, ref_kwargs)
    hc = hbp.HCModule(model, budget=budget)
    got = train_step(hc, model, case, args, kwargs)
    assert_same_step(expected, got, case.exact)
    plan = hc.plan
    recomputed = got.flops > expected.flops
    return dict(
        model=case.name,
        budget=budget,
        granularity=hc.captured.granularity,
        plain_peak=expected.peak_bytes,
        peak=got.peak_bytes,
        budget_bytes=plan.budget_bytes,
        predicted=plan.predicted_peak_bytes,
        naive_predicted=plan.naive_peak_bytes,
        recompute_segments=sum(s.recompute for s in plan.segments),
        recomputed=recomputed,
        extra_flops=got.flops - expected.flops,
        predicted_flops=plan.predicted_recompute_flops,
        hc=hc,
    )
