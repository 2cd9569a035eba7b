"""Encoder-decoder models (transformers): BART, Marian (sinusoidal positions), Whisper (a
conv front end over log-mel frames) and BigBird-Pegasus (block-sparse attention), each
trained through `.loss` on shifted labels.

Builders return `(model, step)` as in `decoders.py`."""

from __future__ import annotations

import torch

from real_models.common import tokens


def bart():
    """BART: encoder-decoder with learned positions, cross-attention, shifted labels."""
    import transformers as t

    config = t.BartConfig(
        vocab_size=512,
        d_model=128,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=256,
        decoder_ffn_dim=256,
        max_position_embeddings=128,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    model = t.BartForConditionalGeneration(config)
    ids, labels = tokens(4, 96), tokens(4, 64)
    return model, lambda m: m(input_ids=ids, labels=labels, use_cache=False).loss.backward()


def marian():
    """Marian MT: encoder-decoder with fixed sinusoidal positions, scaled embeddings, a
    final-logits bias buffer."""
    import transformers as t

    config = t.MarianConfig(
        vocab_size=512,
        decoder_vocab_size=512,
        d_model=128,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=256,
        decoder_ffn_dim=256,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=0,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    model = t.MarianMTModel(config)
    ids, labels = tokens(4, 96), tokens(4, 64)
    return model, lambda m: m(input_ids=ids, labels=labels, use_cache=False).loss.backward()


def whisper():
    """Whisper: two 1-D convs over log-mel frames, sinusoidal encoder positions, decoder with
    cross-attention, labels shifted behind the decoder start token."""
    import transformers as t

    config = t.WhisperConfig(
        vocab_size=512,
        num_mel_bins=16,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=64,
        max_target_positions=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    model = t.WhisperForConditionalGeneration(config)
    features = torch.randn(4, 16, 128)  # (B, mel bins, 2 * max_source_positions frames)
    labels = tokens(4, 32)
    return model, lambda m: m(
        input_features=features, labels=labels, use_cache=False
    ).loss.backward()


def bigbird_pegasus_config(attention: str = "block_sparse", encoder_layers: int = 2):
    """The zoo's BigBird-Pegasus config (also experiments/bigbird_estimate.py's)."""
    import transformers as t

    return t.BigBirdPegasusConfig(
        vocab_size=512,
        d_model=64,
        encoder_layers=encoder_layers,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        attention_type=attention,
        block_size=16,
        num_random_blocks=2,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )


def bigbird_pegasus():
    """BigBird-Pegasus: block-sparse encoder attention (gathers of random blocks, an in-place
    `unsqueeze_`, writes into one buffer), a dense decoder with cross-attention."""
    import transformers as t

    model = t.BigBirdPegasusForConditionalGeneration(bigbird_pegasus_config())
    ids, labels = tokens(2, 256), tokens(2, 16)
    return model, lambda m: m(input_ids=ids, labels=labels, use_cache=False).loss.backward()


MODELS = {
    f.__name__: f
    for f in (
        bart,
        marian,
        whisper,
        bigbird_pegasus,
    )
}
