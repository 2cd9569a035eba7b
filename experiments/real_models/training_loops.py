"""The allocator's peak of hbp in the training loops users write, at the library's own
checkpointing peak and at "min", with no flag but the budget.

    python experiments/real_models/training_loops.py [--models gpt2,llama,...] [--steps 3]

Each model is built from its config (random weights), trained as its users train it
(`model(**batch).loss.backward()` for transformers and PEFT; the caller's MSE on `.sample`
for a diffusers UNet), and `hbp.enable(model, budget=...)` is the only change. Per model:
the plain step's peak, the peak with the library's own checkpointing
(`gradient_checkpointing_enable()` / `enable_gradient_checkpointing()`), then hbp at that peak
in bytes and at "min": the allocator's peak of the last step (bytes above the level before the
step: activations, gradients, workspace; CPU: profiler memory events), its ratio to the
budget, and the recompute FLOPs of the plan. Memory figures are exact; no timings.
"""

from __future__ import annotations

import argparse
import copy
import os
import warnings

import torch
import torch.nn.functional as F

import hbp
from hbp.allocator import allocator_peak
from hbp.units import MIB

VOCAB, BATCH, TOKENS = 1024, 4, 128


def _ids():
    return torch.randint(0, VOCAB, (BATCH, TOKENS))


def _lm_batch():
    ids = _ids()
    return {"input_ids": ids, "labels": ids}


def gpt2():
    import transformers as t

    config = t.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=TOKENS)
    return t.GPT2LMHeadModel(config), _lm_batch()


def _llama_config():
    import transformers as t

    return t.LlamaConfig(
        num_hidden_layers=4, hidden_size=128, intermediate_size=344, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB,
    )  # fmt: skip


def llama():
    import transformers as t

    return t.LlamaForCausalLM(_llama_config()), _lm_batch()


def qwen2():
    import transformers as t

    config = t.Qwen2Config(
        num_hidden_layers=4, hidden_size=128, intermediate_size=344, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=True,
    )  # fmt: skip
    return t.Qwen2ForCausalLM(config), _lm_batch()


def bert():
    import transformers as t

    config = t.BertConfig(
        num_hidden_layers=4, hidden_size=128, intermediate_size=512, num_attention_heads=4,
        vocab_size=VOCAB,
    )  # fmt: skip
    ids = _ids()
    labels = torch.full_like(ids, -100)
    labels[:, ::7] = ids[:, ::7]
    return t.BertForMaskedLM(config), {"input_ids": ids, "labels": labels}


def t5():
    import transformers as t

    config = t.T5Config(
        num_layers=3, num_decoder_layers=3, d_model=128, d_ff=512, num_heads=4, d_kv=32,
        vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return t.T5ForConditionalGeneration(config), {"input_ids": _ids(), "labels": _ids()}


def lora_llama():
    from peft import LoraConfig, get_peft_model

    model, batch = llama()
    config = LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return get_peft_model(model, config), batch


def unet():
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(
        sample_size=32, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        attention_head_dim=8, norm_num_groups=16,
    )  # fmt: skip
    batch = {
        "sample": torch.randn(4, 4, 32, 32),
        "timestep": torch.tensor([10, 20, 30, 40]),
        "encoder_hidden_states": torch.randn(4, 7, 32),
    }
    return model, batch


MODELS = {
    "gpt2": gpt2, "llama": llama, "qwen2": qwen2, "bert": bert, "t5": t5,
    "lora_llama": lora_llama, "unet": unet,
}  # fmt: skip


def train_step(model, batch) -> None:
    """One step as the model's users write it."""
    if "sample" in batch:  # diffusers: the caller's loss on the predicted noise
        noise = torch.ones_like(batch["sample"])
        F.mse_loss(model(**batch).sample, noise).backward()
    else:
        model(**batch).loss.backward()


def measured_peak(model, batch, steps: int) -> int:
    """The allocator's peak of the last of `steps` steps."""
    for _ in range(steps - 1):
        model.zero_grad(set_to_none=True)
        train_step(model, batch)
    model.zero_grad(set_to_none=True)
    return allocator_peak(lambda: train_step(model, batch))[1]


def library_checkpointing(model) -> None:
    if hasattr(model, "enable_gradient_checkpointing"):  # diffusers
        model.enable_gradient_checkpointing()
    else:
        model.gradient_checkpointing_enable({"use_reentrant": False})


def row(name: str, steps: int) -> dict:
    torch.manual_seed(0)
    model, batch = MODELS[name]()
    model.train()
    plain = measured_peak(copy.deepcopy(model), batch, steps)
    library = copy.deepcopy(model)
    library_checkpointing(library)
    library_peak = measured_peak(library, batch, steps)
    out = {"model": name, "naive": plain, "library": library_peak}
    for label, budget in (("at_library", library_peak), ("min", "min")):
        enabled = hbp.enable(copy.deepcopy(model), budget=budget)
        peak = measured_peak(enabled, batch, steps)
        engine = hbp.engine_of(enabled)
        plan = engine.plan
        out[label] = peak
        out[f"{label}_budget"] = plan.budget_bytes
        out[f"{label}_recompute"] = (plan.predicted_recompute_flops or 0) / plan.naive_flops
        out[f"{label}_granularity"] = engine.captured.granularity
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    header = (
        f"{'model':<11} {'naive':>8} {'library':>8} | {'hbp@lib':>8} {'/budget':>7} "
        f"{'recomp':>6} | {'hbp@min':>8} {'min':>8} {'/min':>6} {'recomp':>6} {'level':>6}"
    )
    print("MiB, allocator peak of the last step; budget = the library's own peak in bytes")
    print(header)
    for name in args.models.split(","):
        r = row(name, args.steps)
        print(
            f"{name:<11} {r['naive'] / MIB:8.2f} {r['library'] / MIB:8.2f} | "
            f"{r['at_library'] / MIB:8.2f} {r['at_library'] / r['at_library_budget']:7.3f} "
            f"{r['at_library_recompute']:6.1%} | {r['min'] / MIB:8.2f} "
            f"{r['min_budget'] / MIB:8.2f} {r['min'] / r['min_budget']:6.3f} "
            f"{r['min_recompute']:6.1%} {r['min_granularity']:>6}",
            flush=True,
        )


if __name__ == "__main__":
    main()
