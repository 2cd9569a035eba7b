"""A new user's trial of HCModule on architectures the tests and workloads do not use, measured
by the CPU allocator.

    python experiments/trial_models.py                    # every model, budgets 0.5 and min
    python experiments/trial_models.py gemma2 bart        # some of them
    python experiments/trial_models.py --compile albert   # also torch.compile(HCModule(...))

Each model is built from its transformers / diffusers config class with random weights and
tiny sizes (nothing downloads), dropout off, and trained the way a user does: `.loss`
(`model(**batch).loss.backward()`, the logits let go) or an MSE on the output. Per model:

- the plain step's peak by the allocator (`allocator_peak`, second step: warm-up first),
- `hbp.estimate(..., keeps_outputs=False)`: its naive peak and predicted peak per budget,
- per budget (0.5 and "min"): a fresh `HCModule`, its first step (capture, scratch
  calibration, plan) timed OUTSIDE any measurement window, then its second step measured by
  the allocator: measured / budget, predicted / measured, recompute (FLOPs of the step over
  the plain step's, minus 1) and the largest gradient difference from plain autograd
  (relative to each parameter gradient's largest entry, floored at 1e-4 of the largest
  gradient entry: see `grad_error`),
- for models whose step changes buffers (BatchNorm running statistics and counters): the
  largest difference of the buffers after HCModule's first step (capture, calibration, plan
  and the step) and after its measured step from those after a plain step from the same
  state ("; buffers first/measured" beside the gradient error: `buffer_error`).

The builders of the third trial (Whisper, BLOOM, GPT-NeoX, Qwen2-MoE, Qwen3, ConvNeXt,
ResNet, Segformer, DETR, AutoencoderKL, SD3) are in `trial_more_models.py`, those of the
fourth (Phi-3, Falcon, OPT, GPT-J, ModernBERT, DINOv2, BEiT, MobileNetV2, EfficientNet,
MobileViT, Marian, DiT, Flux, UNet1DModel, ControlNet) in `trial_fourth_models.py`.

Writes outputs/trial/models.md (the table) and outputs/trial/models.json (the rows).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from trial_fourth_models import FOURTH  # this script's folder is on sys.path
from trial_more_models import MORE

import hbp
from hbp.runtime.flops import TotalFlopCounterMode
from hbp.runtime.tracker import allocator_peak
from hbp.units import MIB

OUT = Path("outputs/trial")


# ----------------------------------------------------------------------------- models
# Each builder returns (model, step): step(module) runs one training step's forward, loss and
# backward on fixed inputs (the same for the plain model and HCModule).


def _tokens(batch, length, vocab=512):
    return torch.randint(3, vocab, (batch, length))


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
    ids = _tokens(4, 96)
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
    ids = _tokens(4, 96)
    return model, lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss.backward()


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
    ids = _tokens(4, 96)
    labels = torch.where(torch.rand(ids.shape) < 0.15, ids, torch.full_like(ids, -100))
    return model, lambda m: m(input_ids=ids, labels=labels).loss.backward()


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
    ids, labels = _tokens(4, 96), _tokens(4, 64)
    return model, lambda m: m(input_ids=ids, labels=labels, use_cache=False).loss.backward()


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


def swin():
    """Swin: shifted-window attention (roll, window partition, relative position bias),
    patch merging."""
    import transformers as t

    config = t.SwinConfig(
        image_size=64,
        patch_size=4,
        embed_dim=32,
        depths=[2, 2, 2],
        num_heads=[2, 4, 8],
        window_size=4,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
    )
    model = t.SwinForImageClassification(config)
    x, labels = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))
    return model, lambda m: m(pixel_values=x, labels=labels).loss.backward()


def pixart():
    """diffusers PixArt-alpha transformer: patch embedding, adaLN-single timestep
    conditioning, cross-attention to a caption, MSE on the predicted noise."""
    import diffusers

    model = diffusers.PixArtTransformer2DModel(
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        num_layers=4,
        cross_attention_dim=64,
        caption_channels=32,
        sample_size=16,
        patch_size=2,
        norm_num_groups=1,
        use_additional_conditions=False,
    )
    x = torch.randn(2, 4, 16, 16)
    caption = torch.randn(2, 12, 32)
    step_t = torch.tensor([10, 500])
    target = torch.randn(2, 4, 16, 16)

    def step(m):
        out = m(x, encoder_hidden_states=caption, timestep=step_t).sample
        F.mse_loss(out, target).backward()

    return model, step


def unet2d_cl_bf16():
    """diffusers UNet2DModel (unconditional: down/up blocks, attention, group norm) in
    channels_last, its forward under CPU bf16 autocast, MSE on the output."""
    import diffusers

    model = diffusers.UNet2DModel(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=16,
        attention_head_dim=16,
    ).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 32, 32).to(memory_format=torch.channels_last)
    target = torch.randn(2, 3, 32, 32)
    timesteps = torch.tensor([3, 700])

    def step(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x, timesteps).sample
        F.mse_loss(out.float(), target).backward()

    return model, step


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
    ids = _tokens(4, 96, vocab=1024)
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
    ids = _tokens(2, 64)
    return model, lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def mamba():
    """Mamba: selective state-space layers (transformers' sequential scan without CUDA
    kernels), depthwise causal convolution."""
    import transformers as t

    config = t.MambaConfig(
        vocab_size=512, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4
    )
    model = t.MambaForCausalLM(config)
    ids = _tokens(2, 32)
    return model, lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss.backward()


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
    ids = _tokens(4, 64)
    labels = torch.randint(0, 3, (4,))
    return model, lambda m: m(input_ids=ids, labels=labels).loss.backward()


def vit_mae():
    """ViT-MAE pre-training: random patch masking (noise, argsort, gather) drawn in the
    forward, encoder on the kept patches, decoder on all; the step seeds the generator."""
    import transformers as t

    config = t.ViTMAEConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=32,
        patch_size=4,
        decoder_hidden_size=32,
        decoder_num_hidden_layers=1,
        decoder_num_attention_heads=4,
        decoder_intermediate_size=64,
        mask_ratio=0.75,
    )
    model = t.ViTMAEForPreTraining(config)
    x = torch.randn(4, 3, 32, 32)

    def step(m):
        torch.manual_seed(1)  # the same masks for the plain step and HCModule's
        m(pixel_values=x).loss.backward()

    return model, step


def clip():
    """CLIP: text and vision towers, projections, contrastive loss over the batch."""
    import transformers as t

    config = t.CLIPConfig(
        text_config=dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=32,
        ),
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=4,
        ),
        projection_dim=32,
    )
    model = t.CLIPModel(config)
    ids = _tokens(4, 16)
    x = torch.randn(4, 3, 32, 32)
    return model, lambda m: m(input_ids=ids, pixel_values=x, return_loss=True).loss.backward()


def sd_unet():
    """diffusers UNet2DConditionModel (Stable Diffusion's): cross-attention to text
    embeddings, timestep embedding, MSE on the predicted noise."""
    import diffusers

    model = diffusers.UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=16,
    )
    x = torch.randn(2, 4, 16, 16)
    timesteps = torch.tensor([10, 500])
    text = torch.randn(2, 8, 32)
    noise = torch.randn(2, 4, 16, 16)
    return model, lambda m: F.mse_loss(
        m(x, timesteps, encoder_hidden_states=text).sample, noise
    ).backward()


MODELS = {
    f.__name__: f
    for f in (
        gemma2,
        mistral_sdpa,
        albert,
        bart,
        wav2vec2,
        swin,
        pixart,
        unet2d_cl_bf16,
        llama_rope_scaled,
        mixtral,
        mamba,
        deberta_v2,
        vit_mae,
        clip,
        sd_unet,
    )
}
MODELS.update(MORE)
MODELS.update(FOURTH)


# ----------------------------------------------------------------------------- measuring


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model, runner, step):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    step(runner)


def measured(model, runner, step):
    """(allocator peak, FLOPs, gradients) of one step of `runner` (model or HCModule)."""
    _, peak = allocator_peak(lambda: _step(model, runner, step))
    grads = _grads(model)
    with TotalFlopCounterMode() as counter:
        _step(model, runner, step)
    return peak, counter.get_total_flops(), grads


def grad_error(got, ref):
    """The largest difference of a parameter's gradient from plain autograd's, relative to
    that gradient's largest entry, floored at 1e-4 of the largest entry of any gradient:
    gradients that are zero in exact arithmetic (an attention key's bias: softmax ignores it)
    are rounding noise of 1e-11, whose relative error says nothing."""
    if set(ref) ^ set(got):
        return float("inf")
    floor = 1e-4 * max(g.abs().max().item() for g in ref.values())
    return max(
        (got[n] - ref[n]).abs().max().item() / max(ref[n].abs().max().item(), floor) for n in ref
    )


def _buffers(model):
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _put_back(model, buffers):
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])


def buffer_error(model, runner, step):
    """The largest difference of the model's buffers (BatchNorm running statistics, its
    counter) after one step of `runner` from those after one plain step from the same state
    (a recomputed BatchNorm must not update them twice); None when the plain step changes
    none. Runs the plain step, puts the buffers back, then runs `runner`'s."""
    before = _buffers(model)
    _step(model, model, step)
    ref = _buffers(model)
    if all(torch.equal(before[n], ref[n]) for n in ref):
        return None
    _put_back(model, before)
    _step(model, runner, step)
    got = _buffers(model)
    return max((got[n].double() - ref[n].double()).abs().max().item() for n in ref)


def _estimate(model, step):
    """hbp.estimate on the call the step makes, from inside it: the model's forward is
    intercepted, and the estimate runs there (under the step's autocast, if any) on the
    same arguments; the step then stops."""
    result = {}

    class _Stop(Exception):
        pass

    def grab(*args, **kwargs):
        del model.forward  # the class's forward again, for the estimate's capture
        result["estimate"] = hbp.estimate(
            model, *args, budgets=(0.5, "min"), keeps_outputs=False, **kwargs
        )
        raise _Stop

    model.forward = grab
    try:
        step(model)
    except _Stop:
        pass
    finally:
        model.__dict__.pop("forward", None)
    return result["estimate"]


def trial(name, budgets=(0.5, "min"), compile_too=False):
    torch.manual_seed(0)
    model, step = MODELS[name]()
    model.train()
    _step(model, model, step)  # warm-up
    naive, naive_flops, ref = measured(model, model, step)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            est = _estimate(model, step)
        except Exception as e:  # noqa: BLE001 - the trial records failures
            est = None
            est_error = f"{type(e).__name__}: {e}"[:300]
    est_s = time.perf_counter() - t0
    row = {
        "model": name,
        "naive_mib": naive / MIB,
        "estimate_s": est_s,
        "estimate_naive_mib": est.naive_peak_bytes / MIB if est else None,
        "estimate_min_mib": est.min_peak_bytes / MIB if est else None,
        "estimate_error": None if est else est_error,
        "estimate_warnings": [str(w.message)[:200] for w in caught],
        "budgets": [],
    }
    predicted = {p.budget: p.predicted_peak_bytes for p in est.frontier} if est else {}
    print(
        f"{name}: naive {naive / MIB:.2f} MiB; estimate naive "
        f"{row['estimate_naive_mib'] or float('nan'):.2f} min "
        f"{row['estimate_min_mib'] or float('nan'):.2f} ({est_s:.1f} s)",
        flush=True,
    )
    variants = [(b, False) for b in budgets] + ([(0.5, True)] if compile_too else [])
    for budget, compiled in variants:
        r = {"budget": str(budget), "compile": compiled}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hc = hbp.HCModule(model, budget=budget)
            runner = torch.compile(hc) if compiled else hc
            try:
                before = _buffers(model)
                _step(model, model, step)
                ref_buffers = _buffers(model)
                _put_back(model, before)
                t0 = time.perf_counter()
                _step(model, runner, step)
                r["first_step_s"] = time.perf_counter() - t0
                first = _buffers(model)
                if any(not torch.equal(before[n], ref_buffers[n]) for n in before):
                    r["buffer_error_first"] = max(
                        (first[n].double() - ref_buffers[n].double()).abs().max().item()
                        for n in first
                    )
                peak, flops, grads = measured(model, runner, step)
                r["buffer_error"] = buffer_error(model, runner, step)
            except Exception as e:  # noqa: BLE001
                r["error"] = f"{type(e).__name__}: {e}"[:400]
                print(f"  {budget}{' compiled' if compiled else ''}: {r['error']}", flush=True)
                r["warnings"] = [str(w.message)[:300] for w in caught]
                row["budgets"].append(r)
                continue
        plan = hc.plan
        r.update(
            granularity=hc.captured.granularity,
            tracer=getattr(hc.captured, "tracer", None),
            budget_mib=plan.budget_bytes / MIB,
            predicted_mib=plan.predicted_peak_bytes / MIB,
            estimate_predicted_mib=predicted.get(budget, 0) / MIB if budget in predicted else None,
            measured_mib=peak / MIB,
            measured_over_budget=peak / plan.budget_bytes,
            predicted_over_measured=plan.predicted_peak_bytes / peak,
            recompute=flops / naive_flops - 1,
            grad_error=grad_error(grads, ref),
            warnings=[str(w.message)[:300] for w in caught],
        )
        row["budgets"].append(r)
        print(
            f"  {budget}{' compiled' if compiled else ''}: {r['granularity']}/{r['tracer']} "
            f"budget {r['budget_mib']:.2f} pred {r['predicted_mib']:.2f} "
            f"measured {r['measured_mib']:.2f} ({r['measured_over_budget']:.3f}x budget, "
            f"pred/meas {r['predicted_over_measured']:.3f}) rec {r['recompute']:.3f} "
            f"err {r['grad_error']:.1e}{_buffer_note(r)} first step {r['first_step_s']:.1f} s",
            flush=True,
        )
        for w in r["warnings"]:
            print("    warning:", w[:200], flush=True)
    return row


def _buffer_note(r) -> str:
    """`; buffers 0.0e+00/0.0e+00`: the buffer errors of the first and the measured step, for
    models whose step changes buffers (BatchNorm statistics); empty for the others."""
    if r.get("buffer_error") is None and r.get("buffer_error_first") is None:
        return ""
    first, later = r.get("buffer_error_first"), r.get("buffer_error")
    return "; buffers " + "/".join("-" if e is None else f"{e:.1e}" for e in (first, later))


def table(rows) -> str:
    lines = [
        "| model | naive MiB (est.) | budget | budget MiB | measured MiB | meas/budget "
        "| pred/meas | est. pred MiB | recompute | max grad err | first step s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        est = row["estimate_naive_mib"]
        naive = f"{row['naive_mib']:.2f} ({est:.2f})" if est else f"{row['naive_mib']:.2f} (-)"
        for r in row["budgets"]:
            label = r["budget"] + (" compiled" if r["compile"] else "")
            if "error" in r:
                lines.append(f"| {row['model']} | {naive} | {label} | {r['error'][:160]} |")
                continue
            ep = r["estimate_predicted_mib"]
            lines.append(
                f"| {row['model']} | {naive} | {label} | {r['budget_mib']:.2f} "
                f"| {r['measured_mib']:.2f} | {r['measured_over_budget']:.3f} "
                f"| {r['predicted_over_measured']:.3f} | {'-' if ep is None else f'{ep:.2f}'} "
                f"| {r['recompute']:.3f} | {r['grad_error']:.1e}{_buffer_note(r)} "
                f"| {r['first_step_s']:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help=f"some of {', '.join(MODELS)} (default all)")
    parser.add_argument("--compile", action="store_true", help="also torch.compile(hc) at 0.5")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    args.models = args.models or list(MODELS)
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    rows = [trial(name, compile_too=args.compile) for name in args.models]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "models" if set(args.models) == set(MODELS) else "models_" + "_".join(args.models)
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    (out / f"{stem}.md").write_text(
        f"`python experiments/trial_models.py {' '.join(args.models)}"
        f"{' --compile' if args.compile else ''}`, torch {torch.__version__}, CPU, 1 thread\n\n"
        + table(rows)
        + "\n"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
