"""Real transformers models as workloads: GPT-2, Llama, BERT, T5 and ViT built from their
config classes with random weights (nothing is downloaded).

    wl = hbp.workloads.build("hf", "small", arch="llama")
    loss = wl.step_loss(wl.model, wl.make_batch(0))     # the model's own loss

`arch` picks the model and the task, each the library's own head with labels, so the library
computes the loss inside the model (as a user's training step does):

    gpt2   GPT2LMHeadModel              causal LM, labels = input ids (shifted inside)
    llama  LlamaForCausalLM             causal LM (RMSNorm, rotary, SwiGLU, grouped KV heads)
    bert   BertForMaskedLM              masked LM, 15% of the tokens masked, the rest -100
    t5     T5ForConditionalGeneration   seq2seq, encoder and decoder of n_layer blocks each
    vit    ViTForImageClassification    image classification, num_labels classes

`model` is `HFLossModel`: the library model under `.library_model` (what
mode=library_checkpoint switches the library's checkpointing on for) whose forward returns
`output.loss`. `model.blocks` lists the library's repeated layers in forward order (for the
facts and for reading, not the chain of hbp's own workloads: the layers take the library's
keyword arguments). Caches are off (`use_cache=False`): a training step keeps no KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hbp.workloads import require
from hbp.workloads.base import Batch

ARCHS = ("gpt2", "llama", "bert", "t5", "vit")
# mode=library_checkpoint: whose checkpointing the model has.
LIBRARY = "transformers"
MASK_PROBABILITY = 0.15  # BERT's masked-LM recipe


@dataclass(frozen=True)
class HFConfig:
    """`arch` with n_layer layers (T5: n_layer in the encoder and n_layer in the decoder) of
    width d_model, n_head heads and a d_ff-wide MLP; text batches of batch_size x seq_len
    tokens from vocab_size (T5's targets also seq_len tokens); ViT batches of batch_size
    3 x image_size x image_size images in patch_size patches and num_labels classes. dropout
    applies wherever the library's config has a dropout (0: deterministic steps)."""

    arch: str = "gpt2"
    n_layer: int = 4
    d_model: int = 128
    n_head: int = 4
    d_ff: int = 512
    vocab_size: int = 1024
    seq_len: int = 128
    batch_size: int = 4
    image_size: int = 64
    patch_size: int = 8
    num_labels: int = 10
    dropout: float = 0.0

    def validate(self) -> None:
        require(self.arch in ARCHS, "arch", self.arch, "one of " + ", ".join(ARCHS))
        for name in ("n_layer", "d_model", "n_head", "d_ff", "vocab_size", "seq_len"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        for name in ("batch_size", "image_size", "patch_size", "num_labels"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        require(
            self.d_model % self.n_head == 0,
            "n_head",
            self.n_head,
            f"a divisor of d_model={self.d_model}",
        )
        require(
            self.image_size % self.patch_size == 0,
            "patch_size",
            self.patch_size,
            f"a divisor of image_size={self.image_size}",
        )
        require(0.0 <= self.dropout < 1.0, "dropout", self.dropout, "a number in [0, 1)")


PROFILES = {
    # Test-sized: a step in a few hundredths of a second.
    "tiny": HFConfig(
        n_layer=2,
        d_model=32,
        n_head=2,
        d_ff=64,
        vocab_size=128,
        seq_len=16,
        batch_size=2,
        image_size=16,
        patch_size=4,
        num_labels=4,
    ),
    # The bench's size on CPU (docs/results.md "HCModule against each library's own
    # checkpointing"): activations several times the parameter gradients, a step in about a
    # second.
    "small": HFConfig(
        n_layer=4,
        d_model=128,
        n_head=4,
        d_ff=512,
        vocab_size=2048,
        seq_len=128,
        batch_size=4,
        image_size=48,
        patch_size=4,
    ),
    # BERT-base / GPT-2 124M shapes with a 512-token batch.
    "medium": HFConfig(
        n_layer=12,
        d_model=768,
        n_head=12,
        d_ff=3072,
        vocab_size=32000,
        seq_len=512,
        batch_size=1,
        image_size=224,
        patch_size=16,
        num_labels=1000,
    ),
    # 24 layers of 1024 (GPT-2 medium / BERT-large shapes).
    "large": HFConfig(
        n_layer=24,
        d_model=1024,
        n_head=16,
        d_ff=4096,
        vocab_size=32000,
        seq_len=1024,
        batch_size=1,
        image_size=384,
        patch_size=16,
        num_labels=1000,
    ),
}


class HFLossModel(nn.Module):
    """A library model whose forward returns the loss it computes from the batch's labels."""

    def __init__(self, library_model: nn.Module, block_lists: list[nn.ModuleList]):
        super().__init__()
        self.library_model = library_model
        # Plain attribute (no second registration of the same modules): the library's layers.
        self.__dict__["_block_lists"] = block_lists

    @property
    def blocks(self) -> nn.ModuleList:
        """The library's repeated layers in forward order (a fresh list; read only)."""
        return nn.ModuleList(layer for layers in self._block_lists for layer in layers)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.library_model(*args, **kwargs).loss


def _library_config(cfg: HFConfig):
    import transformers as tf

    common = dict(vocab_size=cfg.vocab_size, use_cache=False)
    if cfg.arch == "gpt2":
        return tf.GPT2Config(
            n_layer=cfg.n_layer, n_embd=cfg.d_model, n_head=cfg.n_head, n_inner=cfg.d_ff,
            n_positions=cfg.seq_len, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout, bos_token_id=0, eos_token_id=0, **common,
        )  # fmt: skip
    if cfg.arch == "llama":
        return tf.LlamaConfig(
            num_hidden_layers=cfg.n_layer, hidden_size=cfg.d_model, num_attention_heads=cfg.n_head,
            num_key_value_heads=max(1, cfg.n_head // 2) if cfg.n_head % 2 == 0 else cfg.n_head,
            intermediate_size=cfg.d_ff, max_position_embeddings=cfg.seq_len,
            attention_dropout=cfg.dropout, **common,
        )  # fmt: skip
    if cfg.arch == "bert":
        return tf.BertConfig(
            num_hidden_layers=cfg.n_layer, hidden_size=cfg.d_model,
            num_attention_heads=cfg.n_head, intermediate_size=cfg.d_ff,
            max_position_embeddings=cfg.seq_len, hidden_dropout_prob=cfg.dropout,
            attention_probs_dropout_prob=cfg.dropout, **common,
        )  # fmt: skip
    if cfg.arch == "t5":
        return tf.T5Config(
            num_layers=cfg.n_layer, num_decoder_layers=cfg.n_layer, d_model=cfg.d_model,
            num_heads=cfg.n_head, d_kv=cfg.d_model // cfg.n_head, d_ff=cfg.d_ff,
            dropout_rate=cfg.dropout, decoder_start_token_id=0, pad_token_id=0, **common,
        )  # fmt: skip
    return tf.ViTConfig(
        num_hidden_layers=cfg.n_layer, hidden_size=cfg.d_model, num_attention_heads=cfg.n_head,
        intermediate_size=cfg.d_ff, image_size=cfg.image_size, patch_size=cfg.patch_size,
        num_labels=cfg.num_labels, hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.dropout,
    )  # fmt: skip


def make_model(cfg: HFConfig) -> HFLossModel:
    import transformers as tf

    config = _library_config(cfg)
    if cfg.arch == "gpt2":
        model = tf.GPT2LMHeadModel(config)
        return HFLossModel(model, [model.transformer.h])
    if cfg.arch == "llama":
        model = tf.LlamaForCausalLM(config)
        return HFLossModel(model, [model.model.layers])
    if cfg.arch == "bert":
        model = tf.BertForMaskedLM(config)
        return HFLossModel(model, [model.bert.encoder.layer])
    if cfg.arch == "t5":
        model = tf.T5ForConditionalGeneration(config)
        return HFLossModel(model, [model.encoder.block, model.decoder.block])
    model = tf.ViTForImageClassification(config)
    return HFLossModel(model, [model.vit.layers])


def make_batch(cfg: HFConfig, seed: int) -> Batch:
    """Seeded random inputs and labels, as keyword arguments of the library model."""
    generator = torch.Generator().manual_seed(seed)
    if cfg.arch == "vit":
        shape = (cfg.batch_size, 3, cfg.image_size, cfg.image_size)
        pixels = torch.randn(shape, generator=generator)
        labels = torch.randint(0, cfg.num_labels, (cfg.batch_size,), generator=generator)
        return Batch(kwargs={"pixel_values": pixels, "labels": labels}, targets=labels)
    shape = (cfg.batch_size, cfg.seq_len)
    ids = torch.randint(0, cfg.vocab_size, shape, generator=generator)
    if cfg.arch in ("gpt2", "llama"):  # the library shifts the labels by one itself
        return Batch(kwargs={"input_ids": ids, "labels": ids}, targets=ids)
    if cfg.arch == "bert":
        masked = torch.rand(shape, generator=generator) < MASK_PROBABILITY
        masked[:, 0] = True  # at least one labelled token per row
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        inputs = torch.where(masked, torch.zeros_like(ids), ids)  # token 0 plays [MASK]
        return Batch(kwargs={"input_ids": inputs, "labels": labels}, targets=labels)
    labels = torch.randint(1, cfg.vocab_size, shape, generator=generator)  # t5; 0 is padding
    return Batch(kwargs={"input_ids": ids, "labels": labels}, targets=labels)


def loss_fn(output: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The model already returns the library's loss."""
    return output


def derived_facts(cfg: HFConfig) -> dict:
    if cfg.arch == "vit":
        patches = (cfg.image_size // cfg.patch_size) ** 2
        return {"samples_per_batch": cfg.batch_size, "tokens_per_batch": cfg.batch_size * patches}
    return {"samples_per_batch": cfg.batch_size, "tokens_per_batch": cfg.batch_size * cfg.seq_len}
