"""measure_step, FLOP counting and timers: exact FLOPs and bytes, consistent fields."""

import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hbp.allocator import allocator_peak
from hbp.errors import ConfigError
from hbp.graph.torch.capture import capture
from hbp.runtime import (
    Timer,
    count_flops,
    count_flops_breakdown,
    measure_callable_peak,
    measure_step,
    phase,
    summarize_times,
)
from hbp.runtime.flops import TotalFlopCounterMode

F32 = 4


def linear_step(layer, x):
    def step():
        loss = layer(x).sum()
        loss.backward()
        return loss

    return step


def test_linear_forward_backward_flops_are_three_matmuls():
    B, n_in, n_out = 16, 32, 8
    layer = nn.Linear(n_in, n_out)
    x = torch.randn(B, n_in, requires_grad=True)  # input grad too: 3 matmuls
    loss, flops = count_flops(linear_step(layer, x))
    assert flops == 3 * 2 * B * n_in * n_out
    assert loss.ndim == 0

    _, total, frame = count_flops_breakdown(linear_step(layer, x))
    assert total == flops
    assert list(frame.columns) == ["module", "op", "flops"]
    global_rows = frame[frame["module"] == "Global"]
    assert global_rows["flops"].sum() == flops
    assert set(global_rows["op"]) == {"aten.addmm", "aten.mm"}


def test_cpu_flash_attention_flops_are_counted_as_the_capture_counts_them():
    """F.scaled_dot_product_attention runs CPU flash attention, which FlopCounterMode has no
    formula for: forward 4·b·h·s²·d (two matmuls), backward 2.5x that; the capture's node
    FLOPs and the measured step agree."""
    b, h, s, d = 2, 4, 64, 16
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))

    def step():
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    forward = 2 * (2 * b * h * s * s * d)
    _, flops, frame = count_flops_breakdown(step)
    assert flops == forward + 5 * forward // 2 > 0
    ops = set(frame[frame["module"] == "Global"]["op"])
    assert ops == {
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._scaled_dot_product_flash_attention_for_cpu_backward",
    }
    assert count_flops(step)[1] == flops
    with TotalFlopCounterMode() as counter:
        step()
    assert counter.get_total_flops() == flops

    class Attention(nn.Module):
        def forward(self, q, k, v):
            return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    node = capture(Attention(), (q, k, v)).graph.nodes[-1]
    assert (node.flops, node.backward_flops) == (forward, 5 * forward // 2)


def test_cpu_lstm_flops_are_its_matmuls_forward_and_backward():
    """nn.LSTM on CPU runs oneDNN's fused layer: per step 2·4h·(input + h) FLOPs a sample
    forward, twice that backward; the capture counts the same."""
    batch, steps, n_in, hidden = 3, 5, 8, 16
    lstm = nn.LSTM(n_in, hidden, batch_first=True)
    x = torch.randn(batch, steps, n_in, requires_grad=True)
    forward = 2 * batch * steps * 4 * hidden * (n_in + hidden)
    _, flops = count_flops(lambda: lstm(x)[0].sum().backward())
    assert flops == 3 * forward

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = lstm

        def forward(self, x):
            return self.lstm(x)[0]

    node = next(n for n in capture(Tagger(), (x,)).graph.nodes if n.op == "LSTM")
    assert (node.flops, node.backward_flops) == (forward, 2 * forward)


def test_measure_step_fields_flops_and_grad_reset():
    B, n_in, n_out = 16, 32, 8
    layer = nn.Linear(n_in, n_out)
    x = torch.randn(B, n_in, requires_grad=True)
    grads_none_at_start = []

    def step():
        grads_none_at_start.append(all(p.grad is None for p in layer.parameters()))
        grads_none_at_start.append(x.grad is None)
        return linear_step(layer, x)()

    m = measure_step(step, params=[*layer.parameters(), x], warmup=2, repeats=3)
    assert grads_none_at_start == [True] * 2 * (2 + 3 + 2)  # warmup, timed, allocator, tracker
    assert m.flops == 3 * 2 * B * n_in * n_out
    assert m.device == "cpu"
    assert len(m.step_times) == 3 and all(t > 0 for t in m.step_times)
    assert m.step_time_p10 <= m.step_time_s <= m.step_time_p90
    assert m.time_summary["n"] == 3
    # Peak at the end of backward: the loss and its seed grad (4 bytes each) and the grads
    # of x, weight and bias, created inside the step because they were reset to None. (The
    # (B, n_out) output is saved by nothing: it died right after the sum.)
    grads = (B * n_in + n_out * n_in + n_out) * F32
    assert m.tensor_peak_bytes == 2 * F32 + grads
    assert m.tensor_peak_bytes == m.timeline["live_bytes"].max()
    assert m.peak_bytes == m.tensor_peak_bytes + m.scratch_bytes >= m.tensor_peak_bytes
    assert m.timeline["phase"].iloc[0] == "forward"
    assert m.timeline["phase"].iloc[-1] == "backward"
    assert m.peak_by_phase["backward"] == m.tensor_peak_bytes
    assert isinstance(m.last_output, torch.Tensor) and not m.last_output.requires_grad
    torch.testing.assert_close(m.last_output, layer(x).sum().detach())


def test_stacked_flop_counter_does_not_change_the_checkpointed_peak():
    blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)) for _ in range(4)
    )
    x = torch.randn(256, 16)

    def step():
        out = x
        for block in blocks:
            out = checkpoint(block, out, use_reentrant=False)
        out.sum().backward()

    m = measure_step(step, params=blocks, warmup=0, repeats=1)
    blocks.zero_grad(set_to_none=True)
    _, alone_peak = measure_callable_peak(step)
    blocks.zero_grad(set_to_none=True)
    _, alone_flops = count_flops(step)
    assert m.tensor_peak_bytes == alone_peak
    blocks.zero_grad(set_to_none=True)
    assert m.peak_bytes == allocator_peak(step)[1]
    assert m.flops == alone_flops
    # 8 Linears forward; backward: 8 weight grads + 7 input grads (x needs none); recompute:
    # only each block's first Linear, because checkpoint stops recomputing once the last
    # saved tensor is back, and the second Linear saves its input before its matmul runs.
    linear_flops = 2 * 256 * 16 * 64
    assert alone_flops == (8 + 15 + 4) * linear_flops


def test_measure_step_options_and_optimizer_phase():
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)

    def step():
        loss = layer(x).square().mean()
        loss.backward()
        with phase("optimizer"):
            optimizer.step()
        return {"loss": loss, "tag": "ok"}

    m = measure_step(step, params=layer, warmup=0, repeats=0, count_flops=False)
    assert m.flops is None
    assert math.isnan(m.step_time_s) and m.step_times == []
    assert m.last_output["tag"] == "ok" and not m.last_output["loss"].requires_grad
    assert set(m.peak_by_phase) == {"forward", "backward", "optimizer"}
    assert m.timeline["phase"].iloc[-1] == "optimizer"

    m = measure_step(step, params=layer, warmup=0, repeats=1, track_memory=False)
    assert m.peak_bytes is None and m.timeline is None and m.peak_by_phase == {}
    assert m.flops > 0

    m = measure_step(step, warmup=0, repeats=1, record_timeline=False)
    assert m.timeline is None and m.peak_bytes > 0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(repeats=-1), "repeats"),
        (dict(warmup=1.5), "warmup"),
        (dict(params=3), "params"),
        (dict(params="x"), "params"),
        (dict(params=[torch.zeros(1), "w"]), "params"),
    ],
)
def test_measure_step_rejects_bad_arguments(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        measure_step(lambda: None, **kwargs)
    with pytest.raises(ConfigError, match="step_fn"):
        measure_step(None)


def test_summarize_times_exact():
    summary = summarize_times([5.0, 1.0, 3.0, 2.0, 4.0])
    assert summary["median"] == 3.0
    assert summary["p10"] == pytest.approx(1.4)
    assert summary["p90"] == pytest.approx(4.6)
    assert summary["mean"] == 3.0
    assert summary["std"] == pytest.approx(math.sqrt(2.5))
    assert summary["n"] == 5
    assert summarize_times([2.0])["std"] == 0.0
    empty = summarize_times([])
    assert empty["n"] == 0 and math.isnan(empty["median"])


def test_timer_measures_elapsed_seconds():
    with Timer("cpu") as timer:
        sum(range(1000))
    assert 0 < timer.elapsed < 60


def test_cuda_control_flow_allocator_step_runs_without_dispatch_modes(monkeypatch):
    """The CUDA branch, run on CPU with the allocator statistics faked: the allocator-measured
    step must run with no dispatch mode active (a mode changes what autograd allocates), and
    FLOPs and the timeline come from one extra instrumented step."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    allocated = {"now": 1000, "peak": 1000}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocated["peak"])
    layer = nn.Linear(8, 4)
    x = torch.randn(2, 8)
    modes = []

    def step():
        modes.append(_get_current_dispatch_mode())
        allocated["peak"] = allocated["now"] + 5000
        return linear_step(layer, x)()

    m = measure_step(step, params=layer, device="cuda", warmup=1, repeats=2)
    assert m.device == "cuda"
    assert m.peak_bytes == 5000
    assert modes[:4] == [None] * 4  # warmup, timed, allocator-measured
    assert len(modes) == 5 and modes[4] is not None  # the instrumented step
    assert m.flops == 2 * (2 * 2 * 8 * 4)  # forward and weight grad (x needs no grad)
    assert m.tensor_peak_bytes == m.timeline["live_bytes"].max() > 0

    modes.clear()
    m = measure_step(step, params=layer, device="cuda", warmup=0, repeats=0,
                     count_flops=False, track_tensors=False)  # fmt: skip
    assert modes == [None] and m.peak_bytes == 5000 and m.flops is None and m.timeline is None


def test_a_cuda_window_is_not_lowered_by_older_garbage_and_collects_nothing(monkeypatch):
    """The CUDA branch of `allocator_peaks`, run on CPU with the allocator statistics faked
    (NOTE [ No cycle collection inside a CUDA window ]): garbage from before the window, in a
    reference cycle, is not freed inside it by the cycle collector (its free would lower the
    level the window's allocation is measured from), and no full collection runs for it (one
    walks every object the process tracks). The collector is on again after it."""
    import gc

    from hbp.allocator import allocator_peaks

    allocated = {"now": 10_000, "peak": 10_000}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(
        torch.cuda,
        "reset_peak_memory_stats",
        lambda device=None: allocated.update(peak=allocated["now"]),
    )
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocated["peak"])
    collect, collections = gc.collect, []
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(args) or 0)

    class Garbage:  # holds 4,000 bytes until the cycle collector frees it
        def __init__(self):
            self.cycle = self

        def __del__(self):
            allocated["now"] -= 4_000

    def allocate_1000_bytes():
        gc.set_threshold(1)  # a collection at the next container allocation, were one due
        kept = [[] for _ in range(5_000)]
        allocated["now"] += 1_000
        allocated["peak"] = max(allocated["peak"], allocated["now"])
        return len(kept)

    thresholds = gc.get_threshold()
    collect()
    gc.set_threshold(1_000_000)  # no collection before the window
    Garbage()
    try:
        (kept,), (peak,) = allocator_peaks(allocate_1000_bytes, device="cuda")
    finally:
        gc.set_threshold(*thresholds)
    assert (kept, peak) == (5_000, 1_000)
    assert collections == [] and gc.isenabled()
    collect()  # the garbage goes after the window
    assert allocated["now"] == 10_000 + 1_000 - 4_000


@pytest.mark.gpu
def test_measure_step_on_cuda_uses_allocator_peak():
    layer = nn.Linear(1024, 1024, device="cuda")
    x = torch.randn(256, 1024, device="cuda")
    target = torch.randn(256, 1024, device="cuda")

    def step():
        loss = nn.functional.mse_loss(layer(x), target)  # a dense output grad: no scratch copy
        loss.backward()
        return loss

    m = measure_step(step, params=layer, warmup=1, repeats=2)
    assert m.device.startswith("cuda")
    # The allocator rounds each block up to 512 bytes (the scalars); every other tensor here
    # is a multiple of 512 bytes, so the allocator's peak is the tracker's plus rounding.
    assert m.tensor_peak_bytes <= m.peak_bytes <= m.tensor_peak_bytes + 64 * 1024
    assert m.flops == 2 * 2 * 256 * 1024 * 1024


def test_peak_bytes_is_the_allocators_and_scratch_is_the_kernel_workspace():
    """A 3x3 convolution's backward allocates im2col-style workspace that no tensor holds:
    `peak_bytes` (the allocator's) sees it, `tensor_peak_bytes` (live storages) does not, and
    the difference is `scratch_bytes`."""
    torch.manual_seed(0)
    conv = nn.Conv2d(32, 32, 3, padding=1)
    x = torch.randn(4, 32, 16, 16, requires_grad=True)

    def step():
        conv(x).square().sum().backward()

    m = measure_step(step, params=[*conv.parameters(), x], warmup=1, repeats=0)
    conv.zero_grad(set_to_none=True)
    x.grad = None
    _, tensors = measure_callable_peak(step)
    conv.zero_grad(set_to_none=True)
    x.grad = None
    _, allocator = allocator_peak(step)
    assert m.tensor_peak_bytes == tensors
    assert m.peak_bytes == allocator
    assert m.scratch_bytes == allocator - tensors > 0
