"""GPT-2 (Radford et al. 2019) in one readable file, in the style of nanoGPT's model.py.

Token + learned position embeddings, `n_layer` pre-LayerNorm blocks (causal self-attention
through F.scaled_dot_product_attention, GELU MLP), a final LayerNorm and an LM head tied to
the token embedding. `model(idx, targets)` returns the mean cross-entropy loss, computed inside
the model so that a planner that captures the model sees the whole step; `model(idx)` returns
the logits [B, T, vocab_size].

The forward is traceable by `torch.fx.symbolic_trace`: no shape asserts, no data-dependent
Python branches; the chunked loss is an fx leaf (`chunked_lm_loss`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hbp.workloads import require
from hbp.workloads.base import Batch


@dataclass(frozen=True)
class GPT2Config:
    """n_layer blocks of width d_model with n_head heads; batches of batch_size x seq_len
    tokens from a vocab_size vocabulary. dropout applies to embeddings, attention weights and
    residual branches; bias: biases in Linear and LayerNorm; chunked_loss: compute the loss
    with hbp.ops.chunked_cross_entropy instead of materialising the [B*T, V] logits."""

    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    vocab_size: int = 2048
    seq_len: int = 128
    batch_size: int = 4
    dropout: float = 0.0
    bias: bool = True
    chunked_loss: bool = False

    def validate(self) -> None:
        for name in ("n_layer", "n_head", "d_model", "vocab_size", "seq_len", "batch_size"):
            value = getattr(self, name)
            require(value >= 1, name, value, "an integer >= 1")
        require(
            self.d_model % self.n_head == 0,
            "n_head",
            self.n_head,
            f"a divisor of d_model={self.d_model}",
        )
        require(0.0 <= self.dropout < 1.0, "dropout", self.dropout, "a number in [0, 1)")


PROFILES = {
    # Test-sized: a step in about a hundredth of a second.
    "tiny": GPT2Config(n_layer=2, n_head=2, d_model=32, vocab_size=128, seq_len=16, batch_size=2),
    # ~0.2 s per step on one CPU thread; activations ~12x the parameter gradients, so
    # budgets down to ~0.2 of the naive peak are feasible.
    "small": GPT2Config(batch_size=8),
    # GPT-2 124M at 8192 tokens per batch: activations ~15x the parameter gradients.
    "medium": GPT2Config(
        n_layer=12, n_head=12, d_model=768, vocab_size=50257, seq_len=1024, batch_size=8
    ),
    # GPT-2 medium, 355M, at 4096 tokens per batch.
    "large": GPT2Config(
        n_layer=24, n_head=16, d_model=1024, vocab_size=50257, seq_len=1024, batch_size=4
    ),
}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: [B, T, d_model] -> [B, T, d_model]."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.attn_dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        # [B, T, d_model] -> [B, n_head, T, head_dim]; unflatten needs no B or T.
        q, k, v = (t.unflatten(-1, (self.n_head, self.head_dim)).transpose(1, 2) for t in (q, k, v))
        dropout_p = self.attn_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).flatten(2)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """d_model -> 4 d_model -> GELU (tanh, as GPT-2) -> d_model."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def chunked_lm_loss(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets` without the logits tensor.

    hidden [B, T, D], weight [V, D], targets [B, T] -> scalar. An fx leaf (torch.fx.wrap), so a
    symbolic trace records one call instead of tracing into the chunked autograd Function.
    """
    from hbp.ops import chunked_cross_entropy

    return chunked_cross_entropy(hidden.flatten(0, 1), weight, targets.flatten())


torch.fx.wrap("chunked_lm_loss")


class GPT2(nn.Module):
    """GPT-2 language model; `blocks` is the chain of transformer blocks."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(number of residual additions).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx [B, T] token ids (T <= seq_len) -> logits [B, T, V], or with targets [B, T]
        the scalar mean cross-entropy."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        h = self.ln_f(x)
        if targets is None:
            return self.lm_head(h)
        if self.config.chunked_loss:
            return chunked_lm_loss(h, self.wte.weight, targets)
        logits = self.lm_head(h)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_model(cfg: GPT2Config) -> GPT2:
    return GPT2(cfg)


def make_batch(cfg: GPT2Config, seed: int) -> Batch:
    """Random token ids; targets are the ids shifted by one, as in language modelling."""
    generator = torch.Generator().manual_seed(seed)
    shape = (cfg.batch_size, cfg.seq_len + 1)
    tokens = torch.randint(0, cfg.vocab_size, shape, generator=generator)
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return Batch(args=(idx, targets), targets=targets)


def loss_fn(output: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The model already returns the loss when given targets."""
    return output


def derived_facts(cfg: GPT2Config) -> dict:
    tokens = cfg.batch_size * cfg.seq_len
    return {"samples_per_batch": cfg.batch_size, "tokens_per_batch": tokens}
