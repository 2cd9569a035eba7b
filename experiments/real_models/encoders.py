"""Encoder models (transformers): ALBERT (shared layer weights), DeBERTa-v2 (disentangled
attention; its loss selects rows with `nonzero`), ModernBERT (sliding-window and global
attention), ModernBERT with right padding, wav2vec2 for CTC (a conv front end on audio) and RoBERTa
token classification.

Builders return `(model, step)` as in `decoders.py`."""

from __future__ import annotations

import torch

from real_models.common import tokens


def albert():
    """ALBERT masked LM: one layer's weights shared by every layer, factorised embeddings."""
    import transformers as t

    config = t.AlbertConfig(
        vocab_size=512,
        embedding_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
        max_position_embeddings=128,
    )
    model = t.AlbertForMaskedLM(config)
    ids = tokens(4, 96)
    labels = torch.where(torch.rand(ids.shape) < 0.15, ids, torch.full_like(ids, -100))
    return model, lambda m: m(input_ids=ids, labels=labels).loss.backward()


def deberta_v2():
    """DeBERTa-v2 sequence classification: disentangled relative-position attention (c2p,
    p2c, log buckets); its loss selects the labelled rows with `nonzero`."""
    import transformers as t

    config = t.DebertaV2Config(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        relative_attention=True,
        position_buckets=32,
        pos_att_type=["p2c", "c2p"],
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = t.DebertaV2ForSequenceClassification(config)
    ids = tokens(4, 64)
    labels = torch.randint(0, 3, (4,))
    return model, lambda m: m(input_ids=ids, labels=labels).loss.backward()


def modernbert():
    """ModernBERT masked LM: global attention every other layer, 32-token sliding window in
    the others, GeGLU MLP, rotary, no biases."""
    import transformers as t

    config = t.ModernBertConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        layer_types=["full_attention", "sliding_attention"] * 2,
        local_attention=32,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
    )
    model = t.ModernBertForMaskedLM(config)
    ids = tokens(4, 96)
    labels = torch.where(torch.rand(ids.shape) < 0.15, ids, torch.full_like(ids, -100))
    return model, lambda m: m(input_ids=ids, labels=labels).loss.backward()


def modernbert_padded():
    """`modernbert` with right padding in the attention mask (two rows cut short)."""
    model, _ = modernbert()
    ids = tokens(4, 96)
    mask = torch.ones(4, 96, dtype=torch.long)
    mask[1, 60:], mask[3, 80:] = 0, 0
    labels = torch.where(torch.rand(ids.shape) < 0.15, ids, torch.full_like(ids, -100))
    return model, lambda m: m(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()


def wav2vec2():
    """wav2vec2 for CTC: a 1-D conv feature extractor (group norm), conv positional
    embedding with weight norm, transformer encoder, CTC loss."""
    import transformers as t

    config = t.Wav2Vec2Config(
        vocab_size=32,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        conv_dim=(32, 32, 32),
        conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        hidden_dropout=0.0,
        activation_dropout=0.0,
        attention_dropout=0.0,
        feat_proj_dropout=0.0,
        final_dropout=0.0,
        layerdrop=0.0,
        mask_time_prob=0.0,
        mask_feature_prob=0.0,
        pad_token_id=0,
        ctc_loss_reduction="mean",
    )
    model = t.Wav2Vec2ForCTC(config)
    audio = torch.randn(2, 8000)
    labels = torch.randint(1, 32, (2, 20))
    return model, lambda m: m(input_values=audio, labels=labels).loss.backward()


def roberta_tokens():
    """RoBERTa token classification (named-entity style): a label per token, some ignored
    (-100), cross-entropy over the labelled ones."""
    import transformers as t

    config = t.RobertaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=130,
        num_labels=9,
    )
    model = t.RobertaForTokenClassification(config)
    ids = tokens(4, 128, 512)
    labels = torch.randint(0, 9, (4, 128))
    labels[:, ::5] = -100

    def step(m):
        m(input_ids=ids, labels=labels).loss.backward()

    return model, step


MODELS = {
    f.__name__: f
    for f in (
        albert,
        deberta_v2,
        modernbert,
        modernbert_padded,
        wav2vec2,
        roberta_tokens,
    )
}
