"""Decoder-only language models (transformers), each trained through `.loss` on its own
labels: Gemma-2, Mistral, Llama, Mixtral, Mamba, BLOOM, GPT-NeoX, Qwen2-MoE, Qwen3, Phi-3,
Falcon, OPT, GPT-J, and variants (Phi-3 under bf16 autocast, OPT with left padding).

Each builder takes no argument and returns `(model, step)`: `step(module)` runs one training
step (forward, loss, backward) of `module`, the plain model or its HCModule, on fixed inputs.
Config classes, random weights, tiny sizes, dropout off: nothing downloads."""

from __future__ import annotations

import torch

from real_models.common import causal_lm_step, tokens


def gemma2():
    """Gemma2: alternating sliding-window / global attention, logit soft-capping, tied
    embeddings, GeGLU MLP, pre+post norms."""
    import transformers as t

    config = t.Gemma2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=32,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    model = t.Gemma2ForCausalLM(config)
    ids = tokens(4, 96)
    return model, lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def mistral_sdpa():
    """Mistral with a sliding window shorter than the sequence, SDPA attention."""
    import transformers as t

    config = t.MistralConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=32,
        max_position_embeddings=256,
    )
    model = t.MistralForCausalLM(config)
    ids = tokens(4, 96)
    return model, lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def llama_rope_scaled():
    """Llama with grouped-query attention and linearly scaled rotary positions."""
    import transformers as t

    config = t.LlamaConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    model = t.LlamaForCausalLM(config)
    ids = tokens(4, 96, vocab=1024)
    return model, lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def mixtral():
    """Mixtral: sparse mixture of experts (top-2 of 4 routed per token, data-dependent expert
    batches), grouped-query attention."""
    import transformers as t

    config = t.MixtralConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    model = t.MixtralForCausalLM(config)
    ids = tokens(2, 64)
    return model, lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def mamba():
    """Mamba: selective state-space layers (transformers' sequential scan without CUDA
    kernels), depthwise causal convolution."""
    import transformers as t

    config = t.MambaConfig(
        vocab_size=512, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4
    )
    model = t.MambaForCausalLM(config)
    ids = tokens(2, 32)
    return model, lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def bloom():
    """BLOOM: ALiBi position biases (no position embeddings), embedding LayerNorm, fused QKV."""
    import transformers as t

    config = t.BloomConfig(
        vocab_size=512,
        hidden_size=128,
        n_layer=4,
        n_head=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return causal_lm_step(t.BloomForCausalLM(config), tokens(4, 96))


def gpt_neox():
    """GPT-NeoX: parallel residual (attention and MLP read the same input), rotary on a
    quarter of each head's dimensions."""
    import transformers as t

    config = t.GPTNeoXConfig(
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=256,
        use_parallel_residual=True,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
    )
    return causal_lm_step(t.GPTNeoXForCausalLM(config), tokens(4, 96))


def qwen2_moe():
    """Qwen2-MoE: top-2 of 4 routed experts beside a sigmoid-gated shared expert in every
    layer, the router's load-balancing loss added to the LM loss."""
    import transformers as t

    config = t.Qwen2MoeConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    )
    return causal_lm_step(t.Qwen2MoeForCausalLM(config), tokens(2, 64))


def qwen3():
    """Qwen3: RMSNorm on each head's queries and keys before rotary, grouped-query attention,
    a head dimension set apart from hidden / heads."""
    import transformers as t

    config = t.Qwen3Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=48,
        max_position_embeddings=256,
    )
    return causal_lm_step(t.Qwen3ForCausalLM(config), tokens(4, 96))


def phi3():
    """Phi-3: fused QKV and gate-up projections (split in the forward), grouped-query
    attention, RMSNorm, rotary."""
    import transformers as t

    config = t.Phi3Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return causal_lm_step(t.Phi3ForCausalLM(config), tokens(4, 96))


def falcon():
    """Falcon's new decoder architecture: separate LayerNorms for attention and MLP, both
    reading the same input (parallel), grouped KV heads, rotary, tied embeddings."""
    import transformers as t

    config = t.FalconConfig(
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_kv_heads=2,
        new_decoder_architecture=True,
        parallel_attn=True,
        alibi=False,
        bias=False,
        max_position_embeddings=256,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return causal_lm_step(t.FalconForCausalLM(config), tokens(4, 96))


def opt():
    """OPT (350m-style): post-LayerNorm, learned positions offset by 2, embeddings narrower
    than the model (project_in / project_out)."""
    import transformers as t

    config = t.OPTConfig(
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=4,
        ffn_dim=256,
        num_attention_heads=4,
        max_position_embeddings=128,
        word_embed_proj_dim=64,
        do_layer_norm_before=False,
        dropout=0.0,
        attention_dropout=0.0,
        layerdrop=0.0,
    )
    return causal_lm_step(t.OPTForCausalLM(config), tokens(4, 96))


def gptj():
    """GPT-J: rotary on the first 16 of 32 dimensions of each head, interleaved
    (rotate-every-two), attention and MLP in parallel off one LayerNorm."""
    import transformers as t

    config = t.GPTJConfig(
        vocab_size=512,
        n_positions=128,
        n_embd=128,
        n_layer=4,
        n_head=4,
        rotary_dim=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return causal_lm_step(t.GPTJForCausalLM(config), tokens(4, 96))


def phi3_bf16():
    """`phi3` with its forward under CPU bf16 autocast, the backward after the block."""
    model, _ = phi3()
    ids = tokens(4, 96)

    def step(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()

    return model, step


def opt_padded():
    """`opt` with left padding in the attention mask (the first row's first 20 tokens)."""
    model, _ = opt()
    ids = tokens(4, 96)
    mask = torch.ones(4, 96, dtype=torch.long)
    mask[0, :20] = 0
    return model, lambda m: m(
        input_ids=ids, attention_mask=mask, labels=ids, use_cache=False
    ).loss.backward()


MODELS = {
    f.__name__: f
    for f in (
        gemma2,
        mistral_sdpa,
        llama_rope_scaled,
        mixtral,
        mamba,
        bloom,
        gpt_neox,
        qwen2_moe,
        qwen3,
        phi3,
        falcon,
        opt,
        gptj,
        phi3_bf16,
        opt_padded,
    )
}
