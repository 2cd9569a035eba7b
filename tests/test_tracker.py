"""MemoryTracker counts exactly the bytes of storages created and freed inside its block.

Every expected number below is worked out by hand from what the ops allocate and what
autograd saves (float32: 4 bytes per element)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hbp.allocator import allocator_peak
from hbp.runtime.tracker import MemoryTracker, measure_callable_peak, phase
from hbp.units import MIB

F32 = 4


def test_tensor_kept_alive_across_an_op_counts_exactly():
    with MemoryTracker() as mt:
        a = torch.ones(1024, 1024)  # 4 MiB, alive across the next op
        total = a.sum()  # a 4-byte scalar
    assert mt.peak_bytes == 4 * MIB + F32
    assert mt.current_bytes == 4 * MIB + F32
    assert mt.timeline[0][1] == 4 * MIB
    del a, total


def test_views_transposes_slices_and_in_place_ops_cost_nothing():
    x = torch.randn(64, 32)
    with MemoryTracker() as mt:
        views = [x.view(32, 64), x.t(), x.transpose(0, 1), x[3:10], x[:, 1], x.detach()]
        views.append(x.unsqueeze(0).expand(4, 64, 32))
        x.add_(1.0)
        x.mul_(2.0).clamp_(min=0.0)
    assert mt.op_count >= 9
    assert mt.peak_bytes == 0
    assert mt.current_bytes == 0
    del views


def test_linear_weight_transpose_is_not_new_memory():
    layer = nn.Linear(48, 80, bias=False)
    x = torch.randn(16, 48)
    with torch.no_grad(), MemoryTracker() as mt:
        y = layer(x)  # aten.t(weight) is a view; only the (16, 80) output is new
    ops = [row[3] for row in mt.timeline]
    assert "aten.t.default" in ops
    assert mt.peak_bytes == 16 * 80 * F32
    del y


def test_in_place_on_new_tensor_and_out_variant_resize():
    x = torch.randn(256)
    with MemoryTracker() as mt:
        a = torch.zeros(256)
        a.add_(x)  # in place: same storage
        out = torch.empty(0)
        torch.mul(x, 2.0, out=out)  # resizes `out` from 0 to 256 floats
    assert mt.peak_bytes == 2 * 256 * F32
    assert mt.current_bytes == 2 * 256 * F32
    del a, out


def test_freed_temporaries_lower_current_and_peak_is_the_maximum():
    x = torch.randn(1024, 256)  # 1 MiB, created before: not counted
    with MemoryTracker() as mt:
        y = (x * 2.0) * 3.0  # the (x * 2) temporary dies right after the second op
        assert mt.current_bytes == 1 * MIB
        big = torch.empty(2 * MIB, dtype=torch.uint8)
        del big
        assert mt.current_bytes == 1 * MIB
        small = torch.empty(MIB // 2, dtype=torch.uint8)
        del x  # a tensor from before __enter__ dying changes nothing
    assert mt.peak_bytes == 3 * MIB  # y + big
    assert mt.current_bytes == 1 * MIB + MIB // 2
    assert mt.timeline_frame()["live_bytes"].tolist() == [MIB, 2 * MIB, 3 * MIB, MIB + MIB // 2]
    del y, small


def test_tensors_from_before_enter_do_not_count_and_reentry_resets():
    kept = torch.randn(512, 512)
    tracker = MemoryTracker()
    with tracker:
        first = kept + 1.0
    assert tracker.peak_bytes == kept.nbytes
    with tracker:  # `first` now exists before __enter__: in-place use of it is free
        first.mul_(2.0)
    assert tracker.peak_bytes == 0
    assert tracker.op_count == 1


def mlp(d_in, d_hidden, d_out):
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_out))


def param_bytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_mlp_forward_backward_peak_matches_hand_computation():
    B, d, h = 64, 256, 512
    model = mlp(d, h, d)
    x = torch.randn(B, d)
    with MemoryTracker() as mt:
        loss = model(x).sum()
        loss.backward()
    # Forward peak at the ReLU: the first Linear's output and the ReLU's output (B, h).
    # (The ReLU saves its output; the first Linear's output dies once the ReLU ran.)
    assert mt.peak_by_phase["forward"] == 2 * B * h * F32
    # Backward peak, when the first Linear's bias grad is made: every parameter grad,
    # the ReLU's input grad (B, h), the loss scalar and autograd's seed grad (4 bytes each).
    assert mt.peak_by_phase["backward"] == param_bytes(model) + B * h * F32 + 2 * F32
    assert mt.peak_bytes == mt.peak_by_phase["backward"]
    # After backward all saved tensors are released: what is left is the grads and the loss.
    assert mt.current_bytes == param_bytes(model) + F32


def test_parameter_grads_count_and_saved_tensors_are_freed_in_backward():
    model = mlp(32, 64, 32)
    x = torch.randn(8, 32)
    with MemoryTracker() as mt:
        model(x).sum().backward()
    assert mt.current_bytes == param_bytes(model)
    grad_bytes = sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
    assert grad_bytes == param_bytes(model)


def test_tied_weights_count_one_gradient():
    V, d, B = 100, 24, 10
    embedding = nn.Embedding(V, d)
    tokens = torch.randint(0, V, (B,))
    with MemoryTracker() as mt:
        hidden = embedding(tokens)
        logits = F.linear(hidden, embedding.weight)  # head tied to the embedding
        logits.sum().backward()
        del hidden, logits
    assert mt.current_bytes == V * d * F32  # one gradient for the shared weight
    assert mt.current_bytes == embedding.weight.grad.untyped_storage().nbytes()


def test_saved_tensors_hooks_copies_are_counted_and_released():
    x = torch.randn(128, 64, requires_grad=True)
    n = x.nbytes
    with MemoryTracker() as mt:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            y = x.sin()  # saves a clone of x
        assert mt.current_bytes == 2 * n
        y.backward(torch.ones_like(y))
        del y
    # forward: y + clone; backward: + ones + cos(x) + grad = the peak; x.grad stays.
    assert mt.peak_bytes == 5 * n
    assert mt.current_bytes == n
    assert x.grad is not None


def blocks_of_mlp(n_blocks, d, h):
    return nn.ModuleList(mlp(d, h, d) for _ in range(n_blocks))


def run_blocks(blocks, x, use_checkpoint):
    out = x
    for block in blocks:
        out = checkpoint(block, out, use_reentrant=False) if use_checkpoint else block(out)
    out.sum().backward()
    return out


@pytest.mark.parametrize("use_checkpoint", [False, True])
def test_checkpoint_lowers_peak_by_the_saved_hidden_activations(use_checkpoint):
    N, B, d, h = 4, 512, 16, 64
    Bd, Bh = B * d * F32, B * h * F32
    blocks = blocks_of_mlp(N, d, h)
    x = torch.randn(B, d)
    with MemoryTracker() as mt:
        run_blocks(blocks, x, use_checkpoint)
    last_linear_grads = (d * h + d) * F32
    if use_checkpoint:
        # Only block inputs 2..N are saved; the last block runs with its (B, h) pre-ReLU
        # and ReLU outputs alive.
        forward_peak = (N - 1) * Bd + 2 * Bh
        # At the last block's ReLU backward: saved block inputs, the final output (held by
        # run_blocks), the recomputed ReLU output, its grad and the ReLU's input grad, the
        # last Linear's grads, the loss and its seed.
        peak = (N - 1) * Bd + Bd + 3 * Bh + last_linear_grads + 2 * F32
    else:
        # Plain autograd also keeps every block's ReLU output (B, h).
        forward_peak = (N - 1) * Bd + (N + 1) * Bh
        peak = (N - 1) * (Bd + Bh) + Bd + 3 * Bh + last_linear_grads + 2 * F32
    assert mt.peak_by_phase["forward"] == forward_peak
    assert mt.peak_bytes == peak
    # Both leave exactly the parameter grads (the output and loss died with run_blocks).
    assert mt.current_bytes == param_bytes(blocks)


def test_nested_checkpoint_frees_every_recomputed_tensor_and_matches_gradients():
    blocks = blocks_of_mlp(4, 16, 64)
    x = torch.randn(256, 16)

    def pair(i, inp):
        return blocks[i + 1](checkpoint(blocks[i], inp, use_reentrant=False))

    def nested(inp):
        inner = checkpoint(pair, 0, inp, use_reentrant=False)
        return checkpoint(pair, 2, inner, use_reentrant=False)

    blocks.zero_grad(set_to_none=True)
    with MemoryTracker() as mt:
        nested(x).sum().backward()
    nested_grads = [p.grad.clone() for p in blocks.parameters()]
    assert mt.current_bytes == param_bytes(blocks)

    blocks.zero_grad(set_to_none=True)
    _, plain_peak = measure_callable_peak(run_blocks, blocks, x, False)
    for p, g in zip(blocks.parameters(), nested_grads):
        torch.testing.assert_close(p.grad, g)
    assert 0 < mt.peak_bytes < plain_peak


def test_timeline_phases_forward_then_backward_then_override():
    model = mlp(8, 16, 8)
    x = torch.randn(4, 8)
    with MemoryTracker() as mt:
        loss = model(x).sum()
        loss.backward()
        with phase("optimizer"):
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(0.1 * p.grad)
        mt.set_phase("eval")
        model(x)
        mt.set_phase(None)
        model(x)
    frame = mt.timeline_frame()
    assert list(frame.columns) == ["op_index", "live_bytes", "phase", "op"]
    assert frame["op_index"].tolist() == list(range(len(frame)))
    phases = frame["phase"].tolist()
    runs = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]
    assert runs == ["forward", "backward", "optimizer", "eval", "forward"]
    assert set(mt.peak_by_phase) == {"forward", "backward", "optimizer", "eval"}
    assert mt.peak_bytes == max(mt.peak_by_phase.values()) == frame["live_bytes"].max()


def test_record_timeline_off_keeps_peak_only_and_numbers_freeze_on_exit():
    with MemoryTracker(record_timeline=False) as mt:
        a = torch.empty(1000, dtype=torch.uint8)
    assert mt.timeline == [] and mt.peak_bytes == 1000 and mt.op_count == 1
    del a  # freed after exit: the finished measurement does not change
    assert mt.current_bytes == 1000


def test_recompute_inside_backward_is_labelled_backward():
    blocks = blocks_of_mlp(2, 8, 16)
    x = torch.randn(4, 8)
    counts = {}
    for use_checkpoint in (False, True):
        with MemoryTracker() as mt:
            run_blocks(blocks, x, use_checkpoint)
        frame = mt.timeline_frame()
        backward_ops = frame[frame["phase"] == "backward"]["op"]
        counts[use_checkpoint] = int((backward_ops == "aten.addmm.default").sum())
    # Backward itself uses mm; the checkpointed run recomputes each block's first Linear
    # (checkpoint stops recomputing once the last saved tensor is back).
    assert counts == {False: 0, True: 2}


def test_nested_trackers_both_count():
    with MemoryTracker() as outer:
        a = torch.empty(1000, dtype=torch.uint8)
        with MemoryTracker() as inner:
            b = torch.empty(3000, dtype=torch.uint8)
            del a
        assert inner.peak_bytes == 3000 and inner.current_bytes == 3000
    assert outer.peak_bytes == 4000 and outer.current_bytes == 3000
    del b


class TinyGPTBlock(nn.Module):
    """Pre-LayerNorm transformer block: causal attention (SDPA with dropout) and a GELU MLP."""

    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)
        x = x + self.drop(self.proj(y.transpose(1, 2).contiguous().view(B, T, C)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


def test_live_bytes_after_forward_equal_what_autograd_saved():
    """Independent check: after a GPT-like forward (tied head, dropout, SDPA, cross-entropy)
    the live bytes are exactly the storages autograd saved (seen by a saved_tensors_hooks
    pack hook, parameters and inputs excluded) plus the loss."""
    V, d = 100, 32
    embedding = nn.Embedding(V, d)
    blocks = nn.Sequential(TinyGPTBlock(d, 4), TinyGPTBlock(d, 4))
    ln_f = nn.LayerNorm(d)
    params = [*embedding.parameters(), *blocks.parameters(), *ln_f.parameters()]
    tokens, targets = torch.randint(0, V, (2, 4, 16))
    outside = {t.untyped_storage()._cdata for t in (*params, tokens, targets)}

    def loss_fn():
        hidden = ln_f(blocks(embedding(tokens)))
        logits = F.linear(hidden, embedding.weight)
        return F.cross_entropy(logits.view(-1, V), targets.view(-1))

    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in outside:
            saved[st._cdata] = st.nbytes()
        return t

    with MemoryTracker() as mt:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn()
        saved.setdefault(loss.untyped_storage()._cdata, loss.untyped_storage().nbytes())
        assert mt.current_bytes == sum(saved.values())
        loss.backward()
        del loss
    assert mt.current_bytes == sum(p.nbytes for p in params)


class ResidualMLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.f = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))

    def forward(self, x):
        return x + self.f(x)


def tiny_gpt_step():
    V, d = 256, 64
    embedding = nn.Embedding(V, d)
    model = nn.Sequential(embedding, TinyGPTBlock(d, 4), TinyGPTBlock(d, 4), nn.LayerNorm(d))
    tokens, targets = torch.randint(0, V, (2, 4, 32))

    def step():
        logits = F.linear(model(tokens), embedding.weight)
        F.cross_entropy(logits.view(-1, V), targets.view(-1)).backward()

    return model, step


def residual_mlp_step():
    model = nn.Sequential(nn.Linear(32, 32), *(ResidualMLP(32, 128) for _ in range(4)))
    x = torch.randn(512, 32)

    def step():
        model(x).square().mean().backward()

    return model, step


@pytest.mark.parametrize("build", [tiny_gpt_step, residual_mlp_step])
def test_peak_equals_cpu_allocator_peak_without_any_dispatch_mode(build):
    """Independent check against the CPU allocator's own events (profiler, no dispatch mode,
    so autograd behaves exactly as in plain training): same peak to the byte."""
    model, step = build()
    step()  # first-call allocations (lazy inits) out of the way
    model.zero_grad(set_to_none=True)
    _, expected = allocator_peak(step)
    model.zero_grad(set_to_none=True)
    with MemoryTracker() as mt:
        step()
    assert mt.peak_bytes == expected
    assert mt.current_bytes == param_bytes(model)


def test_allocator_peak_counts_allocations_above_the_level_before_the_call():
    before = torch.empty(10_000, dtype=torch.uint8)  # alive before: not counted

    def fn():
        a = torch.empty(1000, dtype=torch.uint8)
        b = torch.empty(3000, dtype=torch.uint8)  # a + b: 4000, the peak
        del a
        c = torch.empty(500, dtype=torch.uint8)  # b + c: 3500
        return b, c

    (b, c), peak = allocator_peak(fn)
    assert peak == 4000
    _, peak = allocator_peak(lambda: None)
    assert peak == 0
    del before, b, c


def test_allocator_peak_sees_kernel_workspace_the_tracker_cannot():
    conv = nn.Conv2d(32, 32, 3, padding=1)
    x = torch.randn(4, 32, 16, 16, requires_grad=True)

    def step():
        conv(x).sum().backward()

    step()
    conv.zero_grad(set_to_none=True)
    with MemoryTracker() as mt:
        step()
    conv.zero_grad(set_to_none=True)
    _, peak = allocator_peak(step)
    # the tracker's tensors are all inside, plus the convolution's scratch buffers
    assert peak > mt.peak_bytes + 4 * 32 * 16 * 16 * F32


def test_allocator_peak_does_not_depend_on_what_earlier_measurements_left_behind():
    # a tensor allocated inside a measurement and freed outside one leaves the allocator's size
    # entry behind; a tensor later allocated (unmeasured) at the same address and freed inside
    # a measurement is reported as a free of that stale size (NOTE [ CPU allocator peak ])
    n = 4096
    for _ in range(100):
        held, _ = allocator_peak(lambda: torch.empty(n, dtype=torch.uint8))
        ptr = held.data_ptr()
        del held
        reused = [torch.empty(n, dtype=torch.uint8)]
        if reused[0].data_ptr() == ptr:
            break
    else:
        pytest.skip("the allocator never gave the same address back")

    def step():
        reused.clear()  # from before the step: freeing it does not lower the level
        return torch.empty(2 * n, dtype=torch.uint8)

    _, peak = allocator_peak(step)
    assert peak == 2 * n
