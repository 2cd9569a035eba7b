"""The baseline modes: selective activation checkpointing ("sac") and torch.compile
with an activation memory budget ("compile_budget") give naive's gradients, keep the
parameter objects, update BatchNorm statistics once, and report their memory."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

import hbp.workloads as workloads
from hbp.allocator import allocator_peak
from hbp.errors import ConfigError
from hbp.modes import build_mode
from hbp.modes.compile_budget import CompileBudgetMode
from hbp.modes.sac import POLICIES, SACMode
from hbp.runtime.tracker import MemoryTracker

TINY_GPT2 = dict(n_layer=2, n_head=2, d_model=32, vocab_size=64, seq_len=16, batch_size=2)
TINY_RESNET = dict(width=4, image_size=16, batch_size=4, num_classes=5)
GRAD_RTOL = 1e-5


def build(name: str, overrides: dict | None = None):
    """The workload at profile small; overrides None: the tiny sizes above, {}: as is."""
    if overrides is None:
        overrides = TINY_GPT2 if name == "gpt2" else TINY_RESNET
    return workloads.build(name, "small", seed=0, **overrides)


def train_step(workload, model, batch) -> list[torch.Tensor]:
    """One forward + backward from zero grads; the grads in order of model.parameters()."""
    for p in model.parameters():
        p.grad = None
    workload.step_loss(model, batch).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def naive_reference(name: str, overrides: dict | None = None):
    """(grads, buffers after one step) of plain autograd on the same seed and batch."""
    workload = build(name, overrides)
    grads = train_step(workload, workload.model, workload.make_batch(0))
    buffers = [b.clone() for b in workload.model.buffers()]
    return grads, buffers


def relative_errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    """||g - w|| / ||w|| per parameter, in float64."""
    assert len(got) == len(want)
    return [
        ((g.double() - w.double()).norm() / w.double().norm().clamp_min(1e-30)).item()
        for g, w in zip(got, want)
    ]


def assert_grads_match(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for i, rel in enumerate(relative_errors(got, want)):
        assert rel < GRAD_RTOL, f"parameter {i}: relative gradient error {rel:.2e}"


def float64_grads(name: str, overrides: dict | None = None) -> list[torch.Tensor]:
    """The exact gradients (up to float64 rounding) of the same model, seed and batch."""
    workload = build(name, overrides)
    model = workload.model.double()
    batch = workload.make_batch(0)
    batch.args = tuple(a.double() if a.is_floating_point() else a for a in batch.args)
    return train_step(workload, model, batch)


def apply_mode(mode, name: str, overrides: dict | None = None):
    workload = build(name, overrides)
    batch = workload.make_batch(0)
    params_before = list(workload.model.parameters())
    model = mode.apply(workload, batch)
    assert all(p is q for p, q in zip(model.parameters(), params_before, strict=True))
    return workload, model, batch


# -- sac --------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["gpt2", "resnet"])
def test_sac_gradients_and_running_stats_equal_naive(policy, name):
    want_grads, want_buffers = naive_reference(name)
    workload, model, batch = apply_mode(SACMode(policy=policy), name)
    assert_grads_match(train_step(workload, model, batch), want_grads)
    # BatchNorm statistics updated once (num_batches_tracked == 1), not again on recompute.
    for got, want in zip(model.buffers(), want_buffers, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_sac_batchnorm_counts_one_update_per_step():
    workload, model, batch = apply_mode(SACMode(policy="recompute_all"), "resnet")
    counters = [b for name, b in model.named_buffers() if name.endswith("num_batches_tracked")]
    assert counters
    for steps in (1, 2):
        train_step(workload, model, batch)
        assert all(int(c) == steps for c in counters)


def test_sac_wraps_every_block_and_reports_policy():
    mode = SACMode(policy="save_attention_only")
    workload, model, _ = apply_mode(mode, "gpt2")
    assert len(model.blocks) == TINY_GPT2["n_layer"]
    assert all(type(b).__name__ == "SelectiveCheckpointBlock" for b in model.blocks)
    info = mode.describe()
    assert info["name"] == "sac" and info["policy"] == "save_attention_only"
    assert info["num_blocks"] == TINY_GPT2["n_layer"]
    assert "_scaled_dot_product_flash_attention_for_cpu" in info["saved_ops"]
    assert "mm" not in info["saved_ops"].split(",")


def step_peak(workload, model, batch) -> int:
    for p in model.parameters():
        p.grad = None
    with MemoryTracker(record_timeline=False) as tracker:
        workload.step_loss(model, batch).backward()
    return tracker.peak_bytes


def test_sac_policies_order_peak_memory():
    """Exact CPU bytes: saving less keeps less. recompute_all < save_matmuls < naive."""
    overrides = dict(TINY_GPT2, n_layer=4, d_model=64, seq_len=64)
    naive_wl = build("gpt2", overrides)
    naive = step_peak(naive_wl, naive_wl.model, naive_wl.make_batch(0))
    peaks = {}
    for policy in ("save_matmuls", "recompute_all"):
        peaks[policy] = step_peak(*apply_mode(SACMode(policy=policy), "gpt2", overrides))
    assert peaks["recompute_all"] < peaks["save_matmuls"] < naive


def test_sac_unknown_policy_lists_the_policies():
    with pytest.raises(ConfigError, match="mode.policy") as info:
        SACMode(policy="save_everything")
    for name in POLICIES:
        assert name in str(info.value)


# -- compile_budget ---------------------------------------------------------------------


def test_compile_budget_rejects_bad_config():
    with pytest.raises(ConfigError, match="mode.backend.*inductor, aot_eager_decomp_partition"):
        CompileBudgetMode(backend="eager")
    for budget in (-0.1, 1.5, "half", True):
        with pytest.raises(ConfigError, match="mode.budget"):
            CompileBudgetMode(budget=budget)


def test_compile_budget_aot_eager_matches_naive_and_leaves_no_trace():
    """Partitioner without fusion (fast to compile) on a conv net with BatchNorm: naive's
    gradients and running statistics; apply's compiling step leaves grads, buffers and the
    RNG state as they were.

    Gradients: with BatchNorm over 4 images of 16x16, float32 eager autograd itself is ~1e-4
    (relative) away from the float64 gradients, so compiled vs eager cannot be held to
    1e-5 here (the small profiles are, in the slow tests): the compiled gradients must be
    as close to the float64 ones as eager float32's are (within 2x)."""
    want_grads, want_buffers = naive_reference("resnet")
    exact_grads = float64_grads("resnet")
    mode = CompileBudgetMode(budget=0.1, backend="aot_eager_decomp_partition")
    workload = build("resnet")
    batch = workload.make_batch(0)
    buffers_before = [b.clone() for b in workload.model.buffers()]
    rng = torch.get_rng_state()
    model = mode.apply(workload, batch)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert list(model.parameters()) == list(workload.model.parameters())
    for got, want in zip(workload.model.buffers(), buffers_before, strict=True):
        assert torch.equal(got, want)

    info = mode.describe()
    assert info["budget"] == 0.1 and info["backend"] == "aot_eager_decomp_partition"
    assert info["compile_time_s"] > 0
    eager_error = max(relative_errors(want_grads, exact_grads))
    compiled_error = max(relative_errors(train_step(workload, model, batch), exact_grads))
    assert compiled_error <= 2 * eager_error
    for got, want in zip(workload.model.buffers(), want_buffers, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    # The allocator sees what the compiled code allocates; report it.
    _, peak = allocator_peak(train_step, workload, model, batch)
    assert peak > 0
    print(f"\ncompile_budget(0.1, aot_eager_decomp_partition) tiny resnet peak: {peak} bytes")

    # A dispatch mode Dynamo does not ignore would silently run the model eagerly.
    with pytest.raises(RuntimeError, match="ignore_compile_internals"):
        with MemoryTracker():
            workload.step_loss(model, batch)


def test_modes_build_from_their_yaml():
    for name, cls in (("sac", SACMode), ("compile_budget", CompileBudgetMode)):
        cfg = OmegaConf.load(f"conf/mode/{name}.yaml")
        mode = build_mode(cfg)
        assert isinstance(mode, cls) and mode.name == name
    with pytest.raises(ConfigError, match="mode.policy"):
        build_mode({"name": "sac", "policy": "nope"})


# -- the small profiles (slow: real workload sizes, Inductor compiles) -------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "resnet"])
def test_small_profiles_sac_and_aot_eager_budget_match_naive(name):
    want_grads, want_buffers = naive_reference(name, {})
    for mode in (SACMode(), CompileBudgetMode(0.1, backend="aot_eager_decomp_partition")):
        workload = build(name, {})
        batch = workload.make_batch(0)
        model = mode.apply(workload, batch)
        assert_grads_match(train_step(workload, model, batch), want_grads)
        for got, want in zip(workload.model.buffers(), want_buffers, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_compile_budget_lowers_the_allocator_peak_on_gpt2_small():
    """Exact allocator bytes on CPU: budget 0.1 keeps fewer activations than budget 1.0."""
    peaks = {}
    for budget in (1.0, 0.1):
        workload = build("gpt2", {})
        batch = workload.make_batch(0)
        model = CompileBudgetMode(budget, backend="aot_eager_decomp_partition").apply(
            workload, batch
        )
        _, peaks[budget] = allocator_peak(train_step, workload, model, batch)
    assert peaks[0.1] < peaks[1.0]


@pytest.mark.parametrize("name", ["gpt2", "resnet"])
def test_inductor_budget_matches_naive(name):
    """Inductor's kernels (compiled at the tiny sizes: their code, not their sizes, is what
    differs from aot_eager) give naive's gradients and statistics."""
    want_grads, want_buffers = naive_reference(name)
    exact_grads = float64_grads(name)
    workload = build(name)
    batch = workload.make_batch(0)
    mode = CompileBudgetMode(0.1, backend="inductor")
    model = mode.apply(workload, batch)
    assert mode.describe()["compile_time_s"] > 0
    # fused kernels sum in another order: as close to the exact gradients as eager is
    eager_error = max(relative_errors(want_grads, exact_grads))
    compiled_error = max(relative_errors(train_step(workload, model, batch), exact_grads))
    assert compiled_error <= 2 * eager_error
    for got, want in zip(workload.model.buffers(), want_buffers, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="Inductor allocates"):

        class CompileAwareTracker(MemoryTracker):
            @classmethod
            def ignore_compile_internals(cls):
                return True

        with CompileAwareTracker():
            workload.step_loss(model, batch)
