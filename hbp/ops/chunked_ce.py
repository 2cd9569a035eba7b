"""Chunked LM head + cross-entropy: the loss of `hidden @ weight.T + bias` without the logits.

For a language model the largest activation of a training step is the logits tensor
[tokens, vocab] (GPT-2: vocab 50257), which autograd saves together with its log-softmax and
which backward turns into a gradient of the same size: three or more [N, V] float32 tensors
that no checkpoint plan can avoid. `chunked_cross_entropy` computes the same loss and
gradients a block of rows (a "chunk") at a time and never holds more than one chunk's
[chunk, V] logits:

forward   per chunk: logits = hidden[rows] @ weight.T + bias (float32); keep per row only the
          logsumexp, the target logit and (label smoothing) the row sum of the logits.
backward  per chunk: recompute the logits, turn them in place into
          G = scale * (softmax - (1 - eps) * onehot(target) - eps / V), accumulate
          grad_hidden[rows] = G @ weight, grad_weight += G.T @ hidden[rows], grad_bias += G.sum(0).

Recomputing costs a fourth [N, D] x [D, V] matmul (naive autograd does three). For reductions
"mean" and "sum" the incoming gradient is a scalar, so the forward, which has each chunk's
softmax in hand, forms the gradients for a unit incoming gradient right away and backward only
scales them (Liger-Kernel's "fused linear cross-entropy" does the same): three matmuls, like
naive. This is the default (`GRADS_IN_FORWARD`); reduction "none" always recomputes.

Precision: the matmuls run in the input dtype (as `hidden @ weight.T` does); everything per
row (max, exp, sums, logsumexp, the gradient of the logits) is float32; for float16/bfloat16
weights, the weight and bias gradients are accumulated across chunks in float32 and rounded
once at the end.
"""

from __future__ import annotations

import torch
import torch.fx
from torch import Tensor

from hbp.units import MIB

#: `chunk_size=None` picks the number of rows whose float32 logits take about this many
#: bytes (see `default_chunk_size` for the measured trade-off).
DEFAULT_CHUNK_BYTES = 64 * MIB

REDUCTIONS = ("mean", "sum", "none")

#: Reductions "mean"/"sum" form the gradients during forward (no logits recompute in
#: backward); False always recomputes. See `_ChunkedCrossEntropy`.
GRADS_IN_FORWARD = True
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def default_chunk_size(
    num_rows: int, vocab_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> int:
    """Rows per chunk so that one chunk's float32 logits [rows, vocab_size] take at most
    `chunk_bytes` bytes (at least 1 row, at most `num_rows`).

    64 MiB is 333 rows at the GPT-2 vocabulary (50257). Every chunk reads the whole weight
    twice and reads and writes the whole weight-gradient accumulator once, so fewer, larger
    chunks cost less memory traffic, while the peak grows by one chunk: the default keeps the
    step near naive's time at a fraction of its peak (docs/results.md, the chunk-size table of
    experiments/bench_chunked_ce.py). The chunk's scratch is one float32 [rows, V] tensor (plus
    its input-dtype copy for float16/bfloat16 inputs).
    """
    rows = chunk_bytes // (4 * max(vocab_size, 1))
    return max(1, min(max(num_rows, 1), rows))


# -- the autograd Function ---------------------------------------------------------------


def _chunk_logits(hidden_rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """float32 logits [rows, V] of one chunk (a fresh tensor the caller may modify in place)."""
    if bias is None:
        logits = torch.mm(hidden_rows, weight.t())
    else:
        logits = torch.addmm(bias, hidden_rows, weight.t())
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def _row_scale(grad_loss: Tensor, valid: Tensor, reduction: str, stat_dtype: torch.dtype) -> Tensor:
    """d(output)/d(loss of row i) times the incoming gradient, per row [N] (0 for ignored
    rows). For "mean" with no valid row the loss is nan (0/0, like F.cross_entropy) and the
    gradients are zero (also like F.cross_entropy)."""
    mask = valid.to(stat_dtype)
    if reduction == "none":
        return grad_loss.reshape(-1).to(stat_dtype) * mask
    scale = grad_loss.to(stat_dtype)
    if reduction == "mean":
        count = mask.sum()
        scale = torch.where(count > 0, scale / count.clamp_min(1), torch.zeros_like(scale))
    return scale * mask


def _exp_to_grad_(
    exp: Tensor, coef: Tensor, target_rows: Tensor, scale: Tensor, smoothing: float
) -> Tensor:
    """In place: exp [rows, V] with exp * coef[:, None] = softmax * scale[:, None] becomes
    dL/dlogits = scale * (softmax - (1 - eps) * onehot(target) - eps / V)."""
    exp.mul_(coef[:, None])
    if smoothing > 0:
        exp.sub_((scale * (smoothing / exp.shape[1]))[:, None])
    return exp.scatter_add_(1, target_rows[:, None], (scale * (smoothing - 1.0))[:, None])


class _GradBuffers:
    """grad_hidden [N, D] (hidden's dtype), grad_weight [V, D] and grad_bias [V] (float32
    for low-precision weights, accumulated across chunks), each None when not needed."""

    def __init__(self, hidden: Tensor, weight: Tensor, needs: tuple[bool, bool, bool]):
        self.low_precision = weight.dtype in (torch.float16, torch.bfloat16)
        acc = dict(
            dtype=torch.float32 if self.low_precision else weight.dtype, device=weight.device
        )
        self.hidden = torch.empty_like(hidden) if needs[0] else None
        self.weight = torch.zeros(weight.shape, **acc) if needs[1] else None
        self.bias = torch.zeros(weight.shape[0], **acc) if needs[2] else None

    def accumulate(self, rows: slice, grad_logits: Tensor, hidden: Tensor, weight: Tensor) -> None:
        """Add one chunk's contribution; `grad_logits` [rows, V] is the float32 dL/dlogits."""
        if self.bias is not None:
            self.bias.add_(grad_logits.sum(dim=0))
        grad_logits = grad_logits.to(weight.dtype)
        if self.hidden is not None:
            torch.mm(grad_logits, weight, out=self.hidden[rows])
        if self.weight is None:
            return
        if self.low_precision:  # mm in the input dtype, accumulation across chunks in float32
            self.weight.add_(torch.mm(grad_logits.t(), hidden[rows]))
        else:
            self.weight.addmm_(grad_logits.t(), hidden[rows])

    def results(self, weight: Tensor, bias: Tensor | None) -> tuple:
        """(grad_hidden, grad_weight, grad_bias) in the dtypes of hidden, weight, bias."""
        grad_weight = None if self.weight is None else self.weight.to(weight.dtype)
        grad_bias = None if self.bias is None else self.bias.to(bias.dtype)
        return self.hidden, grad_weight, grad_bias


class _RowStats:
    """Per-row statistics the forward keeps [N]: logsumexp, target logit, row sum of logits
    (only with label smoothing)."""

    def __init__(self, num_rows: int, dtype: torch.dtype, device, smoothing: float):
        self.lse = torch.empty(num_rows, dtype=dtype, device=device)
        self.target_logit = torch.empty_like(self.lse)
        self.logit_sum = torch.empty_like(self.lse) if smoothing > 0 else None

    def row_loss(self, valid: Tensor, smoothing: float, vocab: int) -> Tensor:
        """loss_i = lse_i - (1 - eps) z_{i,t_i} - eps/V sum_j z_ij (0 where ignored)."""
        loss = self.lse - (1.0 - smoothing) * self.target_logit
        if self.logit_sum is not None:
            loss = loss - (smoothing / vocab) * self.logit_sum
        return loss.masked_fill(~valid, 0.0)


def _forward_chunk(rows, hidden, weight, bias, safe_target, stats, grads, unit_scale, smoothing):
    """Fill `stats` for `rows`; if `grads` is given, also accumulate the rows' gradients for
    per-row scales `unit_scale`. A function so that the chunk's scratch dies on return."""
    logits = _chunk_logits(hidden[rows], weight, bias)
    stats.target_logit[rows] = logits.gather(1, safe_target[rows, None]).squeeze(1)
    if stats.logit_sum is not None:
        torch.sum(logits, dim=1, out=stats.logit_sum[rows])
    row_max = logits.amax(dim=1)
    row_max.masked_fill_(torch.isinf(row_max), 0.0)  # a row of -inf: avoid inf - inf
    exp = logits.sub_(row_max[:, None]).exp_()
    sum_exp = exp.sum(dim=1)
    stats.lse[rows] = torch.log(sum_exp).add_(row_max)
    if grads is not None:
        scale = unit_scale[rows]
        grad_logits = _exp_to_grad_(exp, scale / sum_exp, safe_target[rows], scale, smoothing)
        grads.accumulate(rows, grad_logits, hidden, weight)


def _backward_chunk(rows, hidden, weight, bias, safe_target, lse, grads, scale, smoothing):
    """Recompute the rows' logits and accumulate their gradients for per-row `scale`."""
    probs = _chunk_logits(hidden[rows], weight, bias).sub_(lse[rows, None]).exp_()
    grad_logits = _exp_to_grad_(probs, scale[rows], safe_target[rows], scale[rows], smoothing)
    grads.accumulate(rows, grad_logits, hidden, weight)


def _chunks(num_rows: int, chunk_size: int):
    for start in range(0, num_rows, chunk_size):
        yield slice(start, min(start + chunk_size, num_rows))


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Inputs: hidden [N, D] (contiguous), weight [V, D], bias [V] or None, target [N] int64,
    then the options. Output: the loss (reduced, or [N] for "none") in hidden's dtype.

    `grads_in_forward` (only used for "mean"/"sum" when a gradient is needed): the forward
    forms the gradients for a unit incoming gradient and saves them (grad_hidden [N, D],
    grad_weight [V, D], grad_bias [V] then live from forward on rather than from backward);
    backward scales them in place. A second backward through a retained graph recomputes.
    Otherwise the forward saves logsumexp [N] and backward recomputes each chunk's logits.
    """

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        target,
        chunk_size,
        ignore_index,
        reduction,
        smoothing,
        grads_in_forward,
    ):
        num_rows, vocab = hidden.shape[0], weight.shape[0]
        stat_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        valid = target != ignore_index
        safe_target = torch.where(valid, target, torch.zeros_like(target))
        needs = tuple(ctx.needs_input_grad[:3])
        fused = grads_in_forward and reduction != "none" and any(needs)
        grads = _GradBuffers(hidden, weight, needs) if fused else None
        unit = torch.ones((), dtype=stat_dtype, device=hidden.device)
        unit_scale = _row_scale(unit, valid, reduction, stat_dtype) if fused else None

        stats = _RowStats(num_rows, stat_dtype, hidden.device, smoothing)
        for rows in _chunks(num_rows, chunk_size):
            _forward_chunk(
                rows, hidden, weight, bias, safe_target, stats, grads, unit_scale, smoothing
            )
        row_loss = stats.row_loss(valid, smoothing, vocab)
        if reduction == "none":
            loss = row_loss
        elif reduction == "sum":
            loss = row_loss.sum()
        else:
            loss = row_loss.sum() / valid.sum()

        ctx.options = (chunk_size, ignore_index, reduction, smoothing)
        ctx.fused = fused
        ctx.fused_used = False
        precomputed = (grads.hidden, grads.weight, grads.bias) if fused else (None,) * 3
        ctx.save_for_backward(hidden, weight, bias, target, stats.lse, *precomputed)
        return loss.to(hidden.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        hidden, weight, bias, target, lse, *precomputed = ctx.saved_tensors
        if ctx.fused and not ctx.fused_used:
            ctx.fused_used = True
            grads = _scale_precomputed(precomputed, grad_loss, weight, bias)
        else:
            grads = _recompute_grads(ctx, hidden, weight, bias, target, lse, grad_loss)
        return (*grads, None, None, None, None, None, None)


def _scale_precomputed(precomputed, grad_loss: Tensor, weight: Tensor, bias: Tensor | None):
    """The forward's unit-gradient buffers times the incoming scalar gradient. `.data` scales
    in place (no second [V, D] buffer) without bumping the saved tensors' version counters, so
    a retained graph can still unpack them (it then recomputes, see `fused_used`)."""
    out = []
    for grad, param in zip(precomputed, (None, weight, bias)):
        if grad is None:
            out.append(None)
            continue
        grad.data.mul_(grad_loss.to(grad.dtype))
        out.append(grad if param is None else grad.to(param.dtype))
    return out


def _recompute_grads(ctx, hidden, weight, bias, target, lse, grad_loss):
    """Gradients of hidden, weight, bias, recomputing each chunk's logits."""
    chunk_size, ignore_index, reduction, smoothing = ctx.options
    valid = target != ignore_index
    safe_target = torch.where(valid, target, torch.zeros_like(target))
    scale = _row_scale(grad_loss, valid, reduction, lse.dtype)
    grads = _GradBuffers(hidden, weight, tuple(ctx.needs_input_grad[:3]))
    for rows in _chunks(hidden.shape[0], chunk_size):
        _backward_chunk(rows, hidden, weight, bias, safe_target, lse, grads, scale, smoothing)
    return grads.results(weight, bias)


# -- the public function -----------------------------------------------------------------


def _find_proxy(*values) -> torch.fx.Proxy | None:
    return next((v for v in values if isinstance(v, torch.fx.Proxy)), None)


def _check_options(chunk_size, reduction, label_smoothing) -> None:
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(
            f"chunk_size={chunk_size!r} is not accepted: expected a positive int or None"
        )
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not accepted: expected one of {REDUCTIONS}")
    if (
        isinstance(label_smoothing, bool)
        or not isinstance(label_smoothing, (int, float))
        or not (0.0 <= label_smoothing <= 1.0)
    ):
        raise ValueError(
            f"label_smoothing={label_smoothing!r} is not accepted: expected a float in [0, 1]"
        )


def _check_tensors(hidden, weight, target, bias) -> None:
    for name, value in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not isinstance(value, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if bias is not None and not isinstance(bias, Tensor):
        raise ValueError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must have shape [N, D] or [B, T, D], got {tuple(hidden.shape)}")
    if hidden.dtype not in FLOAT_DTYPES:
        raise ValueError(f"hidden must have a floating dtype {FLOAT_DTYPES}, got {hidden.dtype}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must have shape [V, D] with D = hidden.shape[-1] = {hidden.shape[-1]} "
            f"(the nn.Linear layout), got {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"weight must be on hidden's device {hidden.device}, got {weight.device}")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(
            f"target must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])} "
            f"(class indices), got {tuple(target.shape)}"
        )
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise ValueError(f"target must hold integer class indices, got dtype {target.dtype}")
    if target.device != hidden.device:
        raise ValueError(f"target must be on hidden's device {hidden.device}, got {target.device}")
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(
                f"bias must have shape [V] = ({weight.shape[0]},), got {tuple(bias.shape)}"
            )
        if bias.dtype != weight.dtype:
            raise ValueError(f"bias must have weight's dtype {weight.dtype}, got {bias.dtype}")
        if bias.device != weight.device:
            raise ValueError(f"bias must be on weight's device {weight.device}, got {bias.device}")


def _check_target_values(target: Tensor, vocab: int, ignore_index: int) -> None:
    """Class indices must lie in [0, V) or equal ignore_index (one host sync; skipped while
    torch.compile traces, where a data-dependent branch would break the graph)."""
    if torch.compiler.is_compiling() or target.numel() == 0:
        return
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        value = int(target[bad][0])
        raise ValueError(
            f"target holds class index {value}, outside [0, {vocab}) and != ignore_index={ignore_index}"
        )


def chunked_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """`F.cross_entropy(hidden @ weight.T + bias, target, ...)` without materialising the logits.

    Args:
        hidden: [N, D] or [B, T, D] float tensor (float16 / bfloat16 / float32 / float64).
        weight: [V, D], the output projection in the nn.Linear layout (a tied embedding
            matrix fits as is); same dtype and device as `hidden`.
        target: [N] or [B, T] integer class indices in [0, V) or `ignore_index`.
        bias: optional [V] bias of the projection.
        chunk_size: rows of the flattened [N, D] hidden per chunk; None picks
            `default_chunk_size(N, V)` (about 64 MiB of float32 logits per chunk).
        ignore_index, reduction ("mean" | "sum" | "none"), label_smoothing: as in
            `F.cross_entropy`; "mean" divides by the number of non-ignored targets (nan if
            there is none, with zero gradients, like F.cross_entropy).

    Returns:
        The loss in `hidden`'s dtype: a scalar, or the shape of `target` for "none".
        Gradients flow to hidden, weight and bias. Peak extra memory is O(chunk_size * V)
        plus O(N) per-row statistics (the weight/bias gradient buffers aside).

    Raises:
        ValueError naming the argument for a bad shape, dtype, device or option, and for a
        target index out of range.

    torch.fx: `symbolic_trace` of a module that calls this function records it as a single
    call_function node (the function is a leaf: called with a Proxy it emits the node).
    """
    _check_options(chunk_size, reduction, label_smoothing)
    if (proxy := _find_proxy(hidden, weight, target, bias)) is not None:
        kwargs = dict(
            bias=bias,
            chunk_size=chunk_size,
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
        )
        return proxy.tracer.create_proxy(
            "call_function", chunked_cross_entropy, (hidden, weight, target), kwargs
        )
    _check_tensors(hidden, weight, target, bias)
    _check_target_values(target, weight.shape[0], ignore_index)
    return _chunked_cross_entropy(
        hidden,
        weight,
        target,
        bias,
        chunk_size,
        ignore_index,
        reduction,
        label_smoothing,
        grads_in_forward=GRADS_IN_FORWARD,
    )


def _chunked_cross_entropy(
    hidden,
    weight,
    target,
    bias,
    chunk_size,
    ignore_index,
    reduction,
    label_smoothing,
    *,
    grads_in_forward,
) -> Tensor:
    """`chunked_cross_entropy` on checked inputs, with the gradient strategy spelled out
    (`grads_in_forward`, see `_ChunkedCrossEntropy`); the bench compares both."""
    flat_hidden = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    flat_target = target.reshape(-1).long()
    if chunk_size is None:
        chunk_size = default_chunk_size(flat_hidden.shape[0], weight.shape[0])
    loss = _ChunkedCrossEntropy.apply(
        flat_hidden,
        weight,
        bias,
        flat_target,
        chunk_size,
        int(ignore_index),
        reduction,
        float(label_smoothing),
        bool(grads_in_forward) and torch.is_grad_enabled(),
    )
    return loss.reshape(target.shape) if reduction == "none" else loss
