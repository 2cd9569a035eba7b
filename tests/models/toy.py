"""Small architectures written from scratch for HCModule's tests (none is one of hbp's
workloads): MLPs, vision nets (a ViT with nn.MultiheadAttention, one built from
nn.TransformerEncoder, an MLP-Mixer, ConvNeXt and MobileNetV2-like blocks, BatchNorm convs),
sequence models (LSTM/GRU, EmbeddingBag), HuggingFace-style and nanoGPT-style language models,
and two convolution front ends whose output gradient comes back transposed (Whisper's, SD3's).

Models built around one trait (tied weights, data-dependent branches, buffers updated in
forward...) are in tests/models/traits.py; each model with its inputs, in tests/models/cases.py."""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

#: Width of the small MLP and transformer blocks.
D = 64


class DropoutMLP(nn.Module):
    def __init__(self, depth=6, width=128):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(D if i == 0 else width, width), nn.GELU(), nn.Dropout(0.3))
            for i in range(depth)
        )
        self.out = nn.Linear(width, D)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            *[
                m
                for cin, cout in [(3, 8), (8, 16), (16, 16), (16, 16)]
                for m in (nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(True))
            ]
        )
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        h = self.features(x)
        h = F.relu(h + self.features[-2](self.features[-3](h)), inplace=True)  # BN runs twice
        return self.fc(h.mean((2, 3)))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.drop = nn.Dropout(0.1)

    def forward(self, x, *, attn_mask=None, return_attn_input=False):
        b, t, _ = x.shape
        q, k, v = (
            h.view(b, t, 4, D // 4).transpose(1, 2) for h in self.qkv(self.ln1(x)).split(D, -1)
        )
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, D)))
        out = {"hidden": x + self.mlp(self.ln2(x)), "norms": (x.norm(), x.abs().mean())}
        if return_attn_input:
            out["attn_input"] = q
        return out


class MLPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


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


class ReducedResidual(nn.Module):
    """A residual MLP whose forward ends in a reduction: the last residual value's gradient is
    the sum's gradient broadcast, which autograd sums out of place with the next one."""

    def __init__(self, d: int = 128, layers: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + F.relu(layer(x))
        return x.sum(-1)


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


class EncoderViT(nn.Module):
    """Patch-embedding conv, cls token, position embedding, nn.TransformerEncoder."""

    def __init__(self, dim=64, depth=2, heads=4, image=32, patch=4):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.1, batch_first=True, norm_first=True, activation="gelu"
        )
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 10)

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.encoder(x)[:, 0])


class MixerBlock(nn.Module):
    def __init__(self, tokens, dim):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(
            nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens)
        )
        self.channel_mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
        )

    def forward(self, x):
        x = x + self.token_mlp(self.ln1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.ln2(x))


class Mixer(nn.Module):
    def __init__(self, dim=64, depth=3):
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 4, 4)
        self.blocks = nn.Sequential(*[MixerBlock(64, dim) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 10)

    def forward(self, x):
        x = self.stem(x).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.blocks(x)).mean(1))


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pw1, self.act, self.pw2 = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(0.1 * torch.ones(dim))  # layer scale

    def forward(self, x):
        h = self.dwconv(x).permute(0, 2, 3, 1)  # channels last for LayerNorm and Linear
        h = self.pw2(self.act(self.pw1(self.norm(h))))
        return x + (self.gamma * h).permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self, dim=32, depth=3):
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 2, 2)
        self.blocks = nn.Sequential(*[ConvNeXtBlock(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


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


class BatchNormMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            *[
                m
                for _ in range(4)
                for m in (nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Tanh(), nn.Dropout(0.1))
            ]
        )

    def forward(self, x):
        return self.layers(x)


class ConvFrontEnd(nn.Module):
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


class PatchEmbed(nn.Module):
    """SD3's patch embedding in small: a strided conv, flattened and transposed to (B, HW, C),
    then `.to` its own dtype (which returns the tensor itself) and the linear layers."""

    def __init__(self, c=4, d=64):
        super().__init__()
        self.proj = nn.Conv2d(c, d, 2, stride=2)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        h = self.proj(x).flatten(2).transpose(1, 2).to(x.dtype)
        return self.fc(nn.functional.silu(h))


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


class GRUHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(32, 64, num_layers=2, batch_first=True)
        self.head = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))

    def forward(self, x, h0=None):
        y, h = self.gru(x, h0)
        return self.head(y), h


class UnrolledCells(nn.Module):
    """Two stacked nn.LSTMCells unrolled over the tokens in Python, each step's output kept in
    a list and stacked after the loop: every cut in the loop is crossed by all the outputs
    before it (NOTE [ Cuts that many values cross ] in hbp.planner.dp.held_sets)."""

    def __init__(self, vocab=100, dim=48):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.first, self.second = nn.LSTMCell(dim, dim), nn.LSTMCell(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.emb(tokens)
        h1 = c1 = h2 = c2 = x.new_zeros(tokens.shape[0], x.shape[-1])
        outputs = []
        for t in range(tokens.shape[1]):
            h1, c1 = self.first(x[:, t], (h1, c1))
            h2, c2 = self.second(h1, (h2, c2))
            outputs.append(h2)
        return self.head(torch.stack(outputs, 1))


class BagMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(1000, 64, mode="mean")
        self.mlp = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)])

    def forward(self, ids, offsets):
        return self.mlp(self.bag(ids, offsets))


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


class CausalAttention(nn.Module):
    """SDPA with is_causal, a head-mixing einsum, and `q, k, v = tensor` unpacking."""

    def __init__(self, dim=64, heads=4, depth=3):
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(depth))
        self.out = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.mix = nn.Parameter(torch.randn(heads, heads) * 0.1)

    def forward(self, x):
        b, t, d = x.shape
        for qkv, out in zip(self.qkv, self.out):
            q, k, v = qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = torch.einsum("bhtd,hg->bgtd", y, self.mix)
            x = x + out(y.transpose(1, 2).reshape(b, t, d))
        return x


@dataclasses.dataclass
class TinyLMOutput:
    loss: torch.Tensor
    logits: torch.Tensor


class TinyLM(nn.Module):
    """Embedding, three MLP blocks, a wide head; the loss computed inside, as transformers'
    models do with labels: the logits (2 MiB at 256 tokens) are the largest tensor of the step."""

    def __init__(self, vocab: int = 2048, width: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(3)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, ids, labels):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(h)
        return TinyLMOutput(nn.functional.cross_entropy(logits, labels), logits)
