"""Fake values for the capture stages: real tensors as fake ones with the same storage
identities (`Faker`), running one fx node on them (`run_fx_node`), and the CPU kernels whose
fake (meta) kernels allocate other sizes than the real ones (`RealStorageSizes`).

Fake tensors (`FakeTensorMode`) have real shapes, dtypes and devices and no memory; the device
is kept, so device-dependent kernels and decompositions are the same as in the real run (CPU
flash attention, CPU dropout's float mask)."""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from hbp.graph.torch.breaks import REAL_RESULTS, RealResults
from hbp.graph.torch.modes import MODES, enter_modes

_aten = torch.ops.aten


# CPU loss kernels that return their (0-dim) reduced loss as a view of an unreduced buffer the
# size of the input, which meta/fake kernels cannot know: aten op -> position of `reduction`.
_CPU_UNREDUCED_LOSSES = {
    _aten.mse_loss.default: 2,
    _aten.smooth_l1_loss.default: 2,
    _aten.soft_margin_loss.default: 2,
    _aten.binary_cross_entropy.default: 3,
}


# CPU ops whose meta kernel gets the size of an output wrong: oneDNN's LSTM layer returns its
# workspace (kept for backward, ~15x the layer's output) as an empty tensor. Learning the real
# size runs the real kernel once, on zeros: the capture briefly allocates what the step will.
_CPU_WRONG_META_SIZES = {_aten.mkldnn_rnn_layer.default}


# Ops whose real kernels (CPU and CUDA) return their first output laid out as
# `empty_like(input, input.suggest_memory_format())`, where the decomposition fake tensors run
# keeps the input's strides (NOTE [ A batch norm's output layout ]).
_SUGGESTED_LAYOUT_OUTPUTS = {
    _aten.native_batch_norm.default,
    _aten._native_batch_norm_legit.default,
    _aten._native_batch_norm_legit.no_stats,
    _aten._native_batch_norm_legit_no_training.default,
}


# NOTE [ A batch norm's output layout ]
# A batch norm of a transposed input (a (batch, channels, length) view of (batch, length,
# channels) values, as time-series and audio models write it) returns a contiguous output
# from the real kernels, but a fake one with the input's strides. The op after it sees
# another layout than the real step: a linear on the transposed-back output then reshapes it
# by a view where the real step copies it, and saves the copy (a whole activation) for its
# backward. So the profile re-makes such an output in the layout the real kernel gives it.


class RealStorageSizes(TorchDispatchMode):
    """Where fake kernels allocate other sizes than the real ones (see above): records the
    real size of unreduced loss buffers, and re-makes the outputs of `_CPU_WRONG_META_SIZES`
    ops at their real sizes (learnt by running the real kernel once on zeros of the same
    shapes), so that what they save and hold is charged right; and the first output of a batch
    norm in the layout its real kernel gives it (NOTE [ A batch norm's output layout ])."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _CPU_WRONG_META_SIZES and all(
            t.device.type == "cpu" for t in tensor_leaves(args)
        ):
            return _resized_like_real(func, args, kwargs, out)
        if func in _SUGGESTED_LAYOUT_OUTPUTS:
            return _laid_out_as_suggested(args[0], out)
        position = _CPU_UNREDUCED_LOSSES.get(func)
        if position is not None:
            x = args[0]
            reduction = args[position] if len(args) > position else kwargs.get("reduction", 1)
            if x.device.type == "cpu" and reduction != 0:
                self.sizes[storage_key(out)] = x.numel() * x.element_size()
        return out


def _laid_out_as_suggested(x: torch.Tensor, out: tuple) -> tuple:
    """`out` with its first tensor re-made empty in `x`'s suggested memory format (the
    channels-last format its strides are in, else contiguous), where it is not."""
    first = out[0]
    layout = torch.contiguous_format
    if x.dim() in (4, 5) and not x.is_contiguous():
        candidate = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        if x.is_contiguous(memory_format=candidate):
            layout = candidate
    if first.is_contiguous(memory_format=layout):
        return out
    return (torch.empty_like(first, memory_format=layout), *out[1:])


def _resized_like_real(func, args, kwargs, fake_out):
    """`fake_out` with every tensor whose real counterpart has another storage size replaced
    by a fake copy of the real one (run on zero-filled real inputs of the same shapes)."""
    fake_mode = next(t.fake_mode for t in tensor_leaves(args) if isinstance(t, FakeTensor))

    def zeros(x):
        return torch.zeros(x.shape, dtype=x.dtype) if isinstance(x, torch.Tensor) else x

    with _disable_current_modes(), unset_fake_temporarily():  # grad mode as is: it matters
        real_args, real_kwargs = tree_map(zeros, (args, kwargs))
        real_out = func(*real_args, **real_kwargs)
    fake_leaves, spec = tree_flatten(fake_out)
    real_leaves, _ = tree_flatten(real_out)
    fixed = [
        fake_mode.from_tensor(r)
        if isinstance(f, torch.Tensor)
        and isinstance(r, torch.Tensor)
        and f.untyped_storage().nbytes() != r.untyped_storage().nbytes()
        else f
        for f, r in zip(fake_leaves, real_leaves, strict=True)
    ]
    return tree_unflatten(fixed, spec)


class Faker:
    """Converts real tensors to fake ones: same shape, dtype, device and requires_grad, and
    one fake storage per real storage (so storage identity, hence aliasing, carries over)."""

    def __init__(self) -> None:
        self.mode = FakeTensorMode(allow_non_fake_inputs=False)
        self._memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """The fake of a persistent tensor (parameter, buffer, constant): one per tensor."""
        if isinstance(t, FakeTensor):
            return t
        hit = self._memo.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        fake = self.mode.from_tensor(t, static_shapes=True)
        self._memo[id(t)] = (t, fake)
        return fake

    def fresh(self, t: torch.Tensor) -> torch.Tensor:
        """A new fake leaf for an input tensor (requires_grad as `t`)."""
        if isinstance(t, FakeTensor):
            return t
        fake = self.mode.from_tensor(t.detach(), static_shapes=True)
        return fake.requires_grad_(True) if t.requires_grad else fake

    def tree(self, value: Any, *, fresh: bool = False) -> Any:
        convert = self.fresh if fresh else self.tensor
        return tree_map(lambda x: convert(x) if isinstance(x, torch.Tensor) else x, value)

    def state_of(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Fake parameters and buffers of `module`, by name (tied names share one fake)."""
        state = dict(module.named_parameters(remove_duplicate=False))
        state.update(module.named_buffers(remove_duplicate=False))
        return {k: self.tensor(v) for k, v in state.items() if v is not None}


def storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    return [x for x in tree_leaves(value) if isinstance(x, torch.Tensor)]


def any_requires_grad(value: Any) -> bool:
    return any(t.requires_grad for t in tensor_leaves(value))


def call_module(faker: Faker | None, module: nn.Module, args, kwargs):
    """Run `module.forward` (no hooks) with fake state, or real state if `faker` is None."""
    if faker is None:
        return module.forward(*args, **kwargs)
    with _reparametrize_module(module, faker.state_of(module)):
        return module.forward(*args, **kwargs)


@contextlib.contextmanager
def _as_if_compiling() -> Iterator[None]:
    """Library code skips host-syncing checks (`if bool((t < 0).any()): raise ...`) while
    torch.compile traces, for the reason fake tensors cannot run them: the value is unknown."""
    original = torch.compiler.is_compiling
    torch.compiler.is_compiling = lambda: True
    try:
        yield
    finally:
        torch.compiler.is_compiling = original


def run_fx_node(node: fx.Node, root: nn.Module, faker: Faker, args, kwargs):
    """Run one node on fake values, in its own modes (`MODES`); a node whose Python needs a
    tensor's value (a host sync) is run again as torch.compile would see it."""
    modes = node.meta.get(MODES)
    results = node.meta.get(REAL_RESULTS)
    with (
        enter_modes(modes) if modes else contextlib.nullcontext(),
        RealResults(results) if results else contextlib.nullcontext(),
    ):
        try:
            return _run_fx_node_once(node, root, faker, args, kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            with _as_if_compiling():
                return _run_fx_node_once(node, root, faker, args, kwargs)


def _run_fx_node_once(node: fx.Node, root: nn.Module, faker: Faker, args, kwargs):
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        obj, *rest = args
        return getattr(obj, node.target)(*rest, **kwargs)
    if node.op == "call_module":
        return call_module(faker, root.get_submodule(node.target), args, kwargs)
    raise AssertionError(f"cannot run fx node {node.op}")


# NOTE [ Outputs made, not computed ]
# Both fake runs of a graph (the tracer's, for the values the forward's Python asks about, and
# the profile stage's) run every node, and a model of repeated layers runs the same op on
# values of the same layout over and over; on fake tensors a decomposed op (a linear: a
# transpose, a matmul, views) costs several dispatches. Where the first such call returned one
# new tensor, dense from offset 0, from a pure call (`pure_call`) that changed none of the
# tensors it was given, a later call with the same signature returns a new tensor of that
# layout on a new storage, and needs no run (`made_layout`, `made_output`): it is made with
# `torch.empty_strided`, as the result of an autograd Function of a given tensor that requires
# grad where the output requires grad (a non-leaf, as a computed output is). What the capture
# reads of a value (metadata, storage identity, requires_grad, leaf or not) is then what the
# run would have given. The signature must fix the output's layout: the op, its non-tensor
# arguments and its tensors' shapes, strides, offsets, dtypes, devices, requires_grad and
# which of them share a storage.


def pure_call(kind: str, target: Any) -> bool:
    """Whether an fx node's call (`kind`: its op; `target`: its target, a module's class)
    changes nothing but the tensors it is given: a Tensor method, a function of torch or the
    `operator` module, a module (callers pass only stateless library modules)."""
    if kind in ("call_method", "call_module"):
        return True
    module = getattr(target, "__module__", None) or ""
    return kind == "call_function" and (
        module in ("_operator", "operator") or module == "torch" or module.startswith("torch.")
    )


def made_layout(out: Any, given: Any) -> tuple | None:
    """(shape, strides, dtype, device, requires_grad) of `out` where a call that returned it
    from `given` (its arguments and parameters) can be replayed by `made_output`: one new dense
    tensor from offset 0 on a storage none of `given` holds; else None (NOTE [ Outputs made,
    not computed ])."""
    if not isinstance(out, torch.Tensor) or out._base is not None or out.storage_offset() != 0:
        return None
    if out.is_complex() or out.layout != torch.strided or out.numel() == 0:
        return None
    span = 1 + sum((size - 1) * stride for size, stride in zip(out.shape, out.stride()))
    if span != out.numel() or out.untyped_storage().nbytes() != out.numel() * out.element_size():
        return None
    leaves = tensor_leaves(given)
    if storage_key(out) in {storage_key(t) for t in leaves}:
        return None
    if out.requires_grad and (out.grad_fn is None or not any(t.requires_grad for t in leaves)):
        return None
    shape = tuple(int(d) for d in out.shape)
    return (shape, tuple(int(d) for d in out.stride()), out.dtype, out.device, out.requires_grad)


class _Made(torch.autograd.Function):
    """A new tensor of a given layout, as the result of an op of `anchor` (a non-leaf)."""

    @staticmethod
    def forward(ctx, anchor, shape, stride, dtype, device):
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, None, None


def tensor_layout(x: torch.Tensor) -> tuple:
    """What an op signature reads of a tensor argument besides its storage: shape, strides,
    storage offset, dtype, device and `requires_grad`."""
    return (
        tuple(int(d) for d in x.shape),
        tuple(int(d) for d in x.stride()),
        int(x.storage_offset()),
        x.dtype,
        x.device,
        x.requires_grad,
    )


def made_output(layout: tuple, given: Any) -> torch.Tensor:
    """A new tensor of `layout` (`made_layout`), made in the active (fake) mode."""
    shape, stride, dtype, device, requires_grad = layout
    if not requires_grad:
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)
    anchor = next(t for t in tensor_leaves(given) if t.requires_grad)
    return _Made.apply(anchor, shape, stride, dtype, device)


class MadeOutputs:
    """The layouts of the fx-node calls' outputs seen so far, by signature, for runs that
    replay them (NOTE [ Outputs made, not computed ])."""

    def __init__(self) -> None:
        self.layouts: dict[tuple, tuple] = {}

    def run(self, node: fx.Node, root: nn.Module, faker: Faker, args, kwargs) -> Any:
        """`run_fx_node(node, root, faker, args, kwargs)` in `faker`'s mode, or its output
        made without running where a call of the same signature returned a new tensor."""
        key, params = self._signature(node, root, faker, args, kwargs)
        given = (args, kwargs, params)
        with faker.mode:
            layout = self.layouts.get(key) if key is not None else None
            if layout is not None:
                return made_output(layout, given)
            touched = tensor_leaves(given) if key is not None else []
            versions = [t._version for t in touched]
            out = run_fx_node(node, root, faker, args, kwargs)
        if key is not None and all(t._version == v for t, v in zip(touched, versions)):
            layout = made_layout(out, given)
            if layout is not None:
                self.layouts[key] = layout
        return out

    @staticmethod
    def _signature(node: fx.Node, root: nn.Module, faker: Faker, args, kwargs):
        """(signature or None where the call cannot be replayed, its module's parameters)."""
        if node.meta.get(MODES) or node.meta.get(REAL_RESULTS):
            return None, ()
        params: tuple = ()
        if node.op == "call_module":
            module = root.get_submodule(node.target)
            if not stateless_module(module):
                return None, ()
            op: Any = (type(module), repr(module), module.training)
            # a stateless module has parameters of its own only (no buffers, no children);
            # read without `named_parameters`, which fx's patching slows while tracing
            params = tuple(faker.tensor(p) for p in module._parameters.values() if p is not None)
        elif node.op in ("call_function", "call_method") and pure_call(node.op, node.target):
            op = (node.op, node.target)
        else:
            return None, ()
        leaves, spec = tree_flatten((args, kwargs, params))
        storages: dict[int, int] = {}
        described: list[tuple] = []
        try:
            for x in leaves:
                if isinstance(x, torch.Tensor):
                    key = storage_key(x)
                    if key is None:
                        return None, ()
                    described.append(
                        (
                            *tensor_layout(x),
                            storages.setdefault(key, len(storages)),
                            int(x.untyped_storage().nbytes()),
                        )
                    )
                elif isinstance(x, _PLAIN) or x is Ellipsis:
                    described.append((type(x), x))
                elif isinstance(x, slice) and all(
                    isinstance(v, (int, type(None))) for v in (x.start, x.stop, x.step)
                ):
                    described.append((slice, x.start, x.stop, x.step))
                else:
                    return None, ()
        except (TypeError, RuntimeError):  # symbolic sizes, ...
            return None, ()
        return (op, str(spec), tuple(described)), params


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout)


# NOTE [ Stateless library modules are profiled once ]
# A call_module node's module may keep Python state its signature does not show, so it is
# profiled in full, except for the torch.nn classes below: their forward reads only their
# parameters and buffers (in the signature), the hyper-parameters their `repr` prints and
# `training`. With no hooks on them, a transformer's Linear projections of every layer
# after the first are then replayed like its functional ops.
STATELESS_MODULES = (
    nn.Linear,
    nn.Embedding,
    nn.LayerNorm,
    nn.GELU,
    nn.ReLU,
    nn.SiLU,
    nn.Tanh,
    nn.Dropout,
    nn.Identity,
    nn.Conv1d,
    nn.Conv2d,
)


def stateless_module(module: nn.Module) -> bool:
    """Whether `module` is one of `STATELESS_MODULES` exactly, without hooks."""
    return (
        type(module) in STATELESS_MODULES
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and not module._backward_hooks
        and not getattr(module, "_backward_pre_hooks", None)
    )


def fetch_attr(root: nn.Module, target: str) -> Any:
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


MISSING = object()


@contextlib.contextmanager
def rng_preserved(module: nn.Module, arguments: dict) -> Iterator[None]:
    """Restore the CPU RNG (and that of every CUDA device in use), Python's `random` and
    numpy's global generator on exit (NOTE [ Random numbers drawn on the host ])."""
    tensors = tensor_leaves(arguments) + list(module.parameters())
    devices = sorted({t.device.index or 0 for t in tensors if t.is_cuda})
    host = HostRandom()
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        host.restore()


class HostRandom:
    """The states of Python's `random` and of numpy's global generator (where numpy is
    imported) when made: `drawn()` says whether either has drawn since, `restore()` puts
    them back."""

    def __init__(self) -> None:
        self.python = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy = numpy.random.get_state() if numpy is not None else None

    def drawn(self) -> list[str]:
        """The generators that drew since: "random" (Python's), "numpy.random"."""
        out = ["random"] if random.getstate() != self.python else []
        numpy = sys.modules.get("numpy")
        if numpy is not None and self.numpy is not None:
            now = numpy.random.get_state()
            if now[2:] != self.numpy[2:] or not numpy.array_equal(now[1], self.numpy[1]):
                out.append("numpy.random")
        return out

    def restore(self) -> None:
        random.setstate(self.python)
        numpy = sys.modules.get("numpy")
        if numpy is not None and self.numpy is not None:
            numpy.random.set_state(self.numpy)


# NOTE [ Random numbers drawn on the host ]
# A forward may draw from Python's `random` or numpy's global generator: a LayerDrop written
# `if random.random() < p: continue`, HuBERT's SpecAugment (`np.random` masks). A tracer runs
# the Python forward once and keeps the ops of that one draw: the graph would skip the same
# layers, apply the same mask, every step (a new user's LayerDrop trained on step 1's draw
# forever, silently). So a tracer whose forward drew from either generator fails, as a data-
# dependent branch does, and the step falls back to module-level cut points, where the
# forward's Python runs each step and draws anew (`_first_tracer` in hbp.graph.torch.capture).
# The capture's own forwards must not move the caller's streams either (the first step then
# drew another mask than the plain model): `rng_preserved` restores both generators, as it
# does torch's.
