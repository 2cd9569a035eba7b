"""Capture a PyTorch module's training step into hbp's IR (`hbp.graph.ir.Graph`).

Why torch.fx symbolic tracing (and not torch.export, make_fx or an AOTAutograd joint graph):
the executor must run the *user's own modules and parameters* eagerly, so that a recomputed
segment re-runs exactly the code the plain model runs (same kernels, same dropout draws, same
BatchNorm buffers, same tied `Parameter` objects receiving `.grad`), with no functionalisation
and no decomposition of the backward. `torch.fx` gives that: nn.Module leaves (Linear, Conv2d,
BatchNorm2d, Dropout, ...) stay `call_module` nodes that call the real submodule, and the
`GraphModule` holds the very same parameter objects. torch.export / make_fx / AOTAutograd work
at aten level on a functionalised copy: finer cut points, but every leaf is decomposed (the
executor would no longer run the module's own forward, BatchNorm/dropout state handling would
have to be re-implemented, and RNG replay on CPU needs extra care); their extra granularity
buys little, because the memory that matters is at module boundaries anyway.

Two refinements over plain `torch.fx.symbolic_trace`:
- Shape specialisation. Capture is per input signature (HCModule caches per signature), so
  every proxy carries the fake value of its node, and `x.size()`, `x.shape`, `x.dim()`,
  `x.dtype`, `x.device`, `len(x)` return concrete values. Shape asserts and shape-dependent
  Python (`b, t = idx.size(); assert t <= block_size`) trace; data-dependent control flow
  (`if x.sum() > 0`) still fails, as it must. Tensor factories (`torch.arange`, `torch.rand`,
  `torch.zeros`, ...) are recorded as graph nodes even when all their arguments are concrete,
  so random draws are not baked into the graph as constants.
- None-valued and scalar (bool/int/float/str) keyword arguments are `concrete_args`.
Then in-place ops are made out of place where no other view of the mutated storage is read
afterwards (`nn.ReLU(inplace=True)` after BatchNorm, `x.add_(y)`, ...): same values, and an
op the IR and the executor can cut before without cloning (`_out_of_place`).

Sizes come from running every node on fake tensors (`FakeTensorMode`: real shapes, dtypes
and devices, no memory; the device is kept, so device-dependent kernels and decompositions
are the same as in the real run, e.g. CPU flash attention and CPU dropout's float mask). For
each node, on fake inputs whose `requires_grad` follows the real run:
- `output_bytes`: bytes of new storage (0 when the output shares an input's storage: views,
  in-place results; `alias_of` names that input);
- `flops`: `hbp.runtime.flops.TotalFlopCounterMode` (`FlopCounterMode` plus the formulas for
  CPU flash attention and oneDNN's LSTM that the measured step counts too);
- what backward keeps: the node runs under `torch.autograd.graph.saved_tensors_hooks` and
  each saved tensor is classified by storage identity: an input's storage -> `saved_inputs`,
  the node's own output -> `saves_output`, a parameter/buffer/constant -> nothing (they are
  not activations), anything else -> `saved_extra_bytes` (dropout masks, norm statistics,
  attention logsumexp, ...);
- `param_grad_bytes`: each trainable parameter charged to its last forward user;
- the node's backward is run too (on detached copies of its inputs), for `backward_flops` and
  for the memory facts recorded on the nodes' fields (see `_record_transients`):
  scratch bytes a node holds only while its forward or backward runs, gradients whose size
  differs from the output's storage (views), inputs whose gradient is the output's gradient
  itself (add, views). With these the simulator matches the tracker-measured peak.

Where op-level capture fails (data-dependent control flow, ops without fake support), hbp
falls back to module-level cut points: the sequence of (top-level) child module calls,
recorded with forward hooks during a fake run (a real `no_grad` run if the fake run fails
too), as a chain of IR nodes, with a `hbp.errors.CaptureWarning` that says why.

Forward code that assigns module attributes: a traced value assigned to a registered buffer
(`self.count += 1`, `self.ema = 0.9 * self.ema + ...`) is recorded as `buffer.copy_(value)`,
so every call updates it; in-place updates of buffers (`self.running.mul_(0.9)`) stay in
place. Assigning a Python value (`self.calls += 1`) is a side effect a graph cannot repeat:
op-level capture fails and hbp falls back to module level, which runs the forward itself.

Capturing does not change the module: parameters and buffers are only read (fake copies are
updated instead; a real no-grad run of the fallback puts buffer values back), attributes the
forward assigns while traced are put back, train/eval flags are untouched, and the RNG state
is restored.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import dataclasses
import functools
import inspect
import math
import operator
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.nn import functional as F
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from hbp.errors import CaptureWarning
from hbp.graph.ir import Graph, Node
from hbp.runtime.flops import FLOP_FORMULAS as CPU_FLOP_FORMULAS  # noqa: F401 (re-export)
from hbp.runtime.flops import TotalFlopCounterMode
from hbp.runtime.recompute import frozen_running_stats, stat_tracking_norms

OP = "op"
MODULE = "module"

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


class _RealStorageSizes(TorchDispatchMode):
    """Where fake kernels allocate other sizes than the real ones (see above): records the
    real size of unreduced loss buffers, and re-makes the outputs of `_CPU_WRONG_META_SIZES`
    ops at their real sizes (learnt by running the real kernel once on zeros of the same
    shapes), so that what they save and hold is charged right."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _CPU_WRONG_META_SIZES and all(t.device.type == "cpu" for t in _tensors(args)):
            return _resized_like_real(func, args, kwargs, out)
        position = _CPU_UNREDUCED_LOSSES.get(func)
        if position is not None:
            x = args[0]
            reduction = args[position] if len(args) > position else kwargs.get("reduction", 1)
            if x.device.type == "cpu" and reduction != 0:
                self.sizes[_storage_key(out)] = x.numel() * x.element_size()
        return out


def _resized_like_real(func, args, kwargs, fake_out):
    """`fake_out` with every tensor whose real counterpart has another storage size replaced
    by a fake copy of the real one (run on zero-filled real inputs of the same shapes)."""
    fake_mode = next(t.fake_mode for t in _tensors(args) if isinstance(t, FakeTensor))

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


# Tensor factories recorded as graph nodes even with concrete arguments (see module docstring).
_FACTORIES = (
    "arange empty empty_strided eye full linspace logspace normal ones rand randint randn "
    "randperm scalar_tensor tensor tril_indices triu_indices zeros"
).split()


# torch.nn modules traced through rather than kept as leaves (see `_Tracer.is_leaf_module`).
_TRACED_TORCH_NN = (
    nn.Transformer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)


@dataclass
class CapturedGraph:
    """A captured module: hbp's IR plus what the executor needs to run it.

    Attributes:
        graph: the IR (one node per value-producing fx node, in fx order; at module
            granularity an input node followed by one node per child module call).
        gm: the traced `torch.fx.GraphModule` (op granularity; None at module granularity).
            Its parameters and submodules are the module's own objects.
        granularity: "op" (fx graph) or "module" (fallback: child module calls).
        fx_nodes: at op granularity, `fx_nodes[i]` is the fx node of IR node i.
        input_names: forward parameter bound to each placeholder, in placeholder order.
        signature: `inspect.signature(module.forward)`.
        mutated_inputs: IR node name -> names of its input nodes it mutates in place.
        mutated_attrs: IR node name -> `get_attr` targets (buffers) it mutates in place.
        module_calls: at module granularity, (module path, occurrence) of IR node i + 1.
        module_groups: at module granularity, (path, occurrence, start, stop, child_starts)
            of each nn.Sequential call expanded into its children: IR nodes [start, stop) are
            the calls of its children (its i-th child's from child_starts[i]), a chain any
            run of which can be checkpointed as one function.
        fallback_reason: why op-level capture failed ("" at op granularity).
        capture_time_s: wall time of the capture in seconds.
        output_template: at op granularity, the forward's return value with `OutputSlot(i)`
            for the i-th value the graph returns (its output node returns a flat tuple).
        inlined_checkpoints: `torch.utils.checkpoint` calls in the forward, traced through.
    """

    graph: Graph
    gm: fx.GraphModule | None
    granularity: str
    fx_nodes: list[fx.Node] = field(default_factory=list)
    input_names: list[str] = field(default_factory=list)
    signature: inspect.Signature | None = None
    mutated_inputs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    mutated_attrs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    module_calls: list[tuple[str, int]] = field(default_factory=list)
    module_groups: list[tuple[str, int, int, int, tuple[int, ...]]] = field(default_factory=list)
    fallback_reason: str = ""
    capture_time_s: float = 0.0
    output_template: Any = None
    inlined_checkpoints: int = 0

    def __post_init__(self) -> None:
        self._fx_index = {n: i for i, n in enumerate(self.fx_nodes)}

    def unflatten_output(self, flat: tuple) -> Any:
        """The module's return value, in its own containers, from the graph's flat outputs."""
        return map_output(self.output_template, OutputSlot, lambda slot: flat[slot.index])

    def fx_node(self, name: str) -> fx.Node:
        """The fx node of the IR node called `name` (op granularity)."""
        return self.fx_nodes[self.graph.index(name)]

    def ir_index(self, node: fx.Node) -> int:
        """Position in the IR's topological order of the IR node made from fx `node`."""
        return self._fx_index[node]

    def ir_node(self, node: fx.Node) -> Node:
        return self.graph.nodes[self._fx_index[node]]


@dataclass(frozen=True)
class OutputSlot:
    """Where the i-th value the captured graph returns goes in the module's return value."""

    index: int


def map_output(value: Any, leaf_type: type, fn: Callable[[Any], Any]) -> Any:
    """`value` with every `leaf_type` instance in it replaced by `fn(leaf)`, containers
    rebuilt with their own types: tuples, namedtuples, lists, dicts and dict subclasses
    (`OrderedDict`, HuggingFace's `ModelOutput`), dataclasses. Other objects are kept as
    they are; one that holds a leaf in its attributes raises TypeError (it cannot be
    rebuilt)."""

    def rebuild(v: Any) -> Any:
        if isinstance(v, leaf_type):
            return fn(v)
        if isinstance(v, tuple):
            items = [rebuild(x) for x in v]
            return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)
        if type(v) is list:
            return [rebuild(x) for x in v]
        if type(v) in (dict, OrderedDict):
            return type(v)((k, rebuild(x)) for k, x in v.items())
        if isinstance(v, (list, dict)) or (dataclasses.is_dataclass(v) and not isinstance(v, type)):
            return _rebuilt_copy(v, rebuild)
        if any(isinstance(x, leaf_type) for x in getattr(v, "__dict__", {}).values()):
            raise TypeError(
                f"the forward returns a {type(v).__name__} holding tensors: HCModule can rebuild "
                "tuples, lists, dicts (and subclasses) and dataclasses"
            )
        return v

    return rebuild(value)


def _rebuilt_copy(v: Any, rebuild: Callable[[Any], Any]) -> Any:
    """A shallow copy of a list/dict subclass or dataclass with its items and fields rebuilt,
    set without calling the class's own `__setitem__`/`__setattr__`/`__post_init__`."""
    new = copy.copy(v)
    if isinstance(v, list):
        list.__init__(new, [rebuild(x) for x in v])
    if isinstance(v, dict):
        for k, x in v.items():
            dict.__setitem__(new, k, rebuild(x))
    if dataclasses.is_dataclass(v):
        for f in dataclasses.fields(v):
            if hasattr(v, f.name):
                object.__setattr__(new, f.name, rebuild(getattr(v, f.name)))
    return new


def capture(module: nn.Module, args: tuple = (), kwargs: dict | None = None) -> CapturedGraph:
    """Capture `module(*args, **kwargs)` (training step: grad enabled, current train/eval
    flags) into hbp's IR. Falls back to module-level cut points, with a `CaptureWarning`,
    where op-level capture fails. The module's state (parameters, buffers, train flags, RNG)
    is unchanged afterwards."""
    start = time.perf_counter()
    kwargs = dict(kwargs or {})
    signature = inspect.signature(module.forward)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    # Dispatch modes the caller has active (a memory tracker, a FLOP counter) must not see
    # the capture's fake computations.
    with _disable_current_modes(), _rng_preserved(module, bound.arguments), torch.enable_grad():
        try:
            captured = _capture_ops(module, bound.arguments, signature)
        except Exception as err:  # noqa: BLE001 - any tracing failure means "fall back"
            reason = f"{type(err).__name__}: {err}".strip().splitlines()[0][:300]
            warnings.warn(
                f"hbp could not capture {type(module).__name__} at operator level ({reason}); "
                "falling back to module-level cut points (child module calls): the plan is "
                "coarser and its memory prediction approximate.",
                CaptureWarning,
                stacklevel=3,
            )
            captured = _capture_modules(module, bound, signature, reason)
    captured.capture_time_s = time.perf_counter() - start
    captured.graph.meta["capture_time_s"] = captured.capture_time_s
    return captured


# ---------------------------------------------------------------------------------------
# Fake values
# ---------------------------------------------------------------------------------------


class _Faker:
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


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _tensors(value: Any) -> list[torch.Tensor]:
    return [x for x in tree_leaves(value) if isinstance(x, torch.Tensor)]


def _requires_grad(value: Any) -> bool:
    return any(t.requires_grad for t in _tensors(value))


def _call_module(faker: _Faker | None, module: nn.Module, args, kwargs):
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


#: fx node meta key: the (grad, autocast) modes a node ran with in the traced forward, where
#: they differ from the modes of the call (`with torch.no_grad():`, `with torch.autocast(...)`
#: inside the forward: fx records the ops, not the context managers around them).
MODES = "hbp_modes"


def ambient_modes() -> tuple:
    """(grad enabled, (CPU autocast enabled, dtype), (CUDA autocast enabled, dtype))."""
    autocast = (
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
    )
    return (torch.is_grad_enabled(), *autocast)


def enter_modes(modes: tuple) -> contextlib.ExitStack:
    """Switch to `modes` (an `ambient_modes()` value); the returned stack's close() undoes it."""
    grad, *autocast = modes
    stack = contextlib.ExitStack()
    stack.enter_context(torch.set_grad_enabled(grad))
    for device, state in zip(("cpu", "cuda"), autocast):
        if (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) != state:
            stack.enter_context(torch.autocast(device, dtype=state[1], enabled=state[0]))
    return stack


def exit_modes(stack: contextlib.ExitStack) -> None:
    stack.close()


def _run_fx_node(node: fx.Node, root: nn.Module, faker: _Faker, args, kwargs):
    """Run one node on fake values, in its own modes (`MODES`); a node whose Python needs a
    tensor's value (a host sync) is run again as torch.compile would see it."""
    modes = node.meta.get(MODES)
    with enter_modes(modes) if modes else contextlib.nullcontext():
        try:
            return _run_fx_node_once(node, root, faker, args, kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            with _as_if_compiling():
                return _run_fx_node_once(node, root, faker, args, kwargs)


def _run_fx_node_once(node: fx.Node, root: nn.Module, faker: _Faker, args, kwargs):
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        obj, *rest = args
        return getattr(obj, node.target)(*rest, **kwargs)
    if node.op == "call_module":
        return _call_module(faker, root.get_submodule(node.target), args, kwargs)
    raise AssertionError(f"cannot run fx node {node.op}")


def _fetch_attr(root: nn.Module, target: str) -> Any:
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# ---------------------------------------------------------------------------------------
# Shape-specialising tracer
# ---------------------------------------------------------------------------------------

_MISSING = object()
_CONCRETE_TYPES = (bool, int, float, str, torch.Size, torch.dtype, torch.device, torch.layout)


class _ValueProxy(fx.Proxy):
    """An fx Proxy that knows its node's fake value: shape queries return concrete values."""

    def _value(self) -> Any:
        return self.tracer.values.get(self.node, _MISSING)

    def _tensor(self) -> torch.Tensor | None:
        v = self._value()
        return v if isinstance(v, torch.Tensor) else None

    def _symbolic(self, method: str, *args):
        return self.tracer.create_proxy("call_method", method, (self, *args), {})

    def size(self, dim=None):
        t = self._tensor()
        if t is None:
            return self._symbolic("size") if dim is None else self._symbolic("size", dim)
        return t.size() if dim is None else t.size(dim)

    def dim(self):
        t = self._tensor()
        return self._symbolic("dim") if t is None else t.dim()

    def numel(self):
        t = self._tensor()
        return self._symbolic("numel") if t is None else t.numel()

    @property
    def shape(self):
        t = self._tensor()
        return fx.proxy.Attribute(self, "shape") if t is None else t.shape

    @property
    def ndim(self):
        t = self._tensor()
        return fx.proxy.Attribute(self, "ndim") if t is None else t.ndim

    @property
    def dtype(self):
        t = self._tensor()
        return fx.proxy.Attribute(self, "dtype") if t is None else t.dtype

    @property
    def device(self):
        t = self._tensor()
        return fx.proxy.Attribute(self, "device") if t is None else t.device

    @property
    def is_cuda(self):
        t = self._tensor()
        return fx.proxy.Attribute(self, "is_cuda") if t is None else t.is_cuda

    def __len__(self):
        v = self._value()
        if v is _MISSING or not hasattr(v, "__len__"):
            return super().__len__()
        return len(v)

    def __iter__(self):
        v = self._value()
        if isinstance(v, (tuple, list)):
            return iter([self[i] for i in range(len(v))])
        if isinstance(v, torch.Tensor) and v.dim() > 0:  # `q, k, v = qkv`: eager unbinds dim 0
            parts = self._symbolic("unbind", 0)
            return iter([parts[i] for i in range(v.shape[0])])
        return super().__iter__()

    def keys(self):
        v = self._value()
        return v.keys() if isinstance(v, dict) else super().keys()

    def __bool__(self):
        v = self._value()
        if isinstance(v, (bool, int, float)):  # a specialised Python value, not a tensor
            return bool(v)
        return super().__bool__()

    def __getattr__(self, k: str):
        # Tensor methods stay lazy (`x.view(...)` becomes one call_method node). Plain
        # attributes specialise: Python values (`x.requires_grad`, `x.is_leaf`) are returned
        # as they are, tensors (`x.T`, `x.mT`) become getattr nodes that carry their value.
        if k.startswith("__") or callable(getattr(torch.Tensor, k, None)):
            return super().__getattr__(k)
        v = self._value()
        if isinstance(v, torch.Tensor):
            try:
                attr = getattr(v, k)
            except Exception:  # noqa: BLE001
                attr = _MISSING
            if attr is None or isinstance(attr, _CONCRETE_TYPES):
                return attr
        return self.tracer.create_proxy("call_function", builtins.getattr, (self, k), {})


class _Tracer(fx.Tracer):
    """`torch.fx.Tracer` whose proxies carry fake values (see the module docstring)."""

    def __init__(self, faker: _Faker, inputs: dict[str, Any]):
        super().__init__(autowrap_modules=(math,))
        # Buffers read in traced (non-leaf) code become get_attr nodes: `self.buf.add_(1)` is
        # recorded, not run on the real buffer.
        self.proxy_buffer_attributes = True
        self.faker = faker
        self.inputs = inputs  # placeholder target -> fake value
        self.values: dict[fx.Node, Any] = {}
        self.computing = False
        self.value_errors: list[str] = []
        self.base_modes = ambient_modes()  # nodes created in other modes record theirs
        self.output_template: Any = None  # forward's return value, proxies as `OutputSlot`s
        self.inlined_checkpoints = 0  # torch.utils.checkpoint calls traced through

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        # The graph returns the forward's proxies as one flat tuple; the containers around
        # them (dicts, dataclasses, ModelOutput, namedtuples, lists) are kept aside as a
        # template, so the executor returns exactly the types the module returns (fx would
        # turn a dict subclass into an immutable_dict and a list into an immutable_list).
        fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)

        def flat_output(*a):
            proxies: list[fx.Proxy] = []

            def slot(proxy: fx.Proxy) -> OutputSlot:
                proxies.append(proxy)
                return OutputSlot(len(proxies) - 1)

            self.output_template = map_output(fn(*a), fx.Proxy, slot)
            return tuple(proxies)

        return flat_output, args

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ValueProxy(node, self)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # torch.nn's transformer stacks are whole models, not ops: as leaves, a ViT built from
        # nn.TransformerEncoder would be one node, with nothing to cut.
        if isinstance(m, _TRACED_TORCH_NN):
            return False
        return super().is_leaf_module(m, module_qualified_name)

    # fx patches nn.Module.__call__ / __getattr__ while tracing; computing a value runs real
    # module code on fake tensors, which must not be traced.
    def call_module(self, m, forward, args, kwargs):
        if self.computing:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if self.computing:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, *rest, **kw):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, *rest, **kw)
        node = proxy.node
        modes = ambient_modes()
        if modes != self.base_modes and kind != "placeholder":
            node.meta[MODES] = modes
        if kind == "placeholder":
            key = target if target in self.inputs else target.rsplit("_", 1)[0]
            self.values[node] = self.inputs.get(key, _MISSING)
        else:
            self.values[node] = self._compute(node)
        return proxy

    def _value(self, node: fx.Node) -> Any:
        if node not in self.values and node.op == "get_attr":
            self.computing = True  # a real attribute, not the parameter proxy fx would give
            try:
                self.values[node] = self.faker.tree(_fetch_attr(self.root, node.target))
            finally:
                self.computing = False
        return self.values.get(node, _MISSING)

    def _compute(self, node: fx.Node) -> Any:
        if node.op == "get_attr":
            return self._value(node)
        missing = []
        args, kwargs = fx.node.map_aggregate(
            (node.args, node.kwargs),
            lambda a: self._lookup(a, missing) if isinstance(a, fx.Node) else a,
        )
        if missing:
            return _MISSING
        args, kwargs = self.faker.tree((args, kwargs))  # real tensor constants -> fake
        self.computing = True
        try:
            with self.faker.mode:
                return _run_fx_node(node, self.root, self.faker, args, kwargs)
        except Exception as err:  # noqa: BLE001 - the node stays symbolic, as in plain fx
            self.value_errors.append(f"{node.format_node()}: {type(err).__name__}: {err}")
            return _MISSING
        finally:
            self.computing = False

    def _lookup(self, node: fx.Node, missing: list) -> Any:
        v = self._value(node)
        if v is _MISSING:
            missing.append(node)
        return v

    @contextlib.contextmanager
    def inlining_checkpoints(self) -> Iterator[None]:
        """Within: `torch.utils.checkpoint.checkpoint(fn, *args, **kwargs)` (reentrant or not,
        also through `checkpoint_sequential`) just calls `fn(*args, **kwargs)`, so its ops are
        traced and hbp's plan decides what is recomputed. Counted in `inlined_checkpoints`."""
        tracer = self

        class InlinedCheckpointFunction:  # stands in for the reentrant CheckpointFunction
            @staticmethod
            def apply(function, preserve_rng_state, *args):
                tracer.inlined_checkpoints += 1
                return function(*args)

        def inlined_generator(fn, *args, **kwargs):  # non-reentrant: set-up, yield, tear-down
            tracer.inlined_checkpoints += 1
            yield

        originals = (
            torch_checkpoint.CheckpointFunction,
            torch_checkpoint._checkpoint_without_reentrant_generator,
        )
        torch_checkpoint.CheckpointFunction = InlinedCheckpointFunction
        torch_checkpoint._checkpoint_without_reentrant_generator = inlined_generator
        try:
            yield
        finally:
            (
                torch_checkpoint.CheckpointFunction,
                torch_checkpoint._checkpoint_without_reentrant_generator,
            ) = originals

    @contextlib.contextmanager
    def recording_buffer_assignments(self) -> Iterator[None]:
        """Within: assigning a traced value to a registered buffer (`self.count += 1`,
        `self.ema = 0.9 * self.ema + 0.1 * x`) is recorded as `buffer.copy_(value)`: each call
        of the graph updates the buffer, as each call of the forward does."""
        tracer = self
        original = nn.Module.__setattr__

        def setattr_recorded(mod: nn.Module, name: str, value: Any) -> None:
            buffers = mod.__dict__.get("_buffers", {})
            if isinstance(value, fx.Proxy) and buffers.get(name) is not None:
                path = tracer.path_of_module(mod)
                target = f"{path}.{name}" if path else name
                buffer = tracer.create_proxy("get_attr", target, (), {})
                tracer.create_proxy("call_method", "copy_", (buffer, value), {})
                return
            original(mod, name, value)

        nn.Module.__setattr__ = setattr_recorded
        try:
            yield
        finally:
            nn.Module.__setattr__ = original

    @contextlib.contextmanager
    def recording_factories(self) -> Iterator[None]:
        """Within: `torch.<factory>(...)` calls made by traced code become graph nodes."""
        originals = {name: getattr(torch, name) for name in _FACTORIES}

        def wrap(fn: Callable) -> Callable:
            @functools.wraps(fn)
            def factory(*args, **kwargs):
                if self.computing:
                    return fn(*args, **kwargs)
                return self.create_proxy("call_function", fn, args, kwargs)

            return factory

        for name, fn in originals.items():
            setattr(torch, name, wrap(fn))
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(torch, name, fn)


def _trace(
    module: nn.Module, arguments: dict[str, Any], signature: inspect.Signature, faker: _Faker
) -> tuple[fx.GraphModule, list[str], _Tracer]:
    """Trace `module` specialised to `arguments` (forward parameter -> real value); return
    the graph module, the forward parameter of each placeholder and the finished tracer."""
    concrete, inputs = {}, {}
    for name, value in arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            inputs["*" + name] = faker.tree(value, fresh=True)
        elif kind is inspect.Parameter.VAR_KEYWORD:
            inputs["**" + name] = faker.tree(value, fresh=True)
        elif value is None or type(value) in (bool, int, float, str):
            concrete[name] = value
            inputs[name] = value
        else:
            inputs[name] = faker.tree(value, fresh=True)
    for t in (*module.parameters(), *module.buffers()):
        faker.tensor(t)  # convert now: fx's patching during tracing makes it ~10x slower
    tracer = _Tracer(faker, inputs)
    state = _ModuleState(module)
    try:
        with (
            tracer.recording_factories(),
            tracer.inlining_checkpoints(),
            tracer.recording_buffer_assignments(),
        ):
            graph = tracer.trace(module, concrete_args=concrete or None)
        gm = fx.GraphModule(tracer.root, graph, class_name=type(module).__name__)
    finally:  # fx stores tensor constants on the traced module; forwards assign attributes
        changed = state.restore()
    # Leaf modules (run, not traced) may cache Python state of their own (an RNN's
    # `_flat_weights`): only traced code's assignments are side effects the graph loses.
    leaves = tuple(
        path + "." for path, m in module.named_modules() if path and tracer.is_leaf_module(m, path)
    )
    python_state = [
        name
        for name, value in changed
        if not isinstance(value, (fx.Proxy, torch.Tensor)) and not name.startswith(leaves)
    ]
    if python_state:
        raise TypeError(
            f"forward assigns Python attribute(s) {', '.join(python_state[:3])}: a traced graph "
            "would not repeat that side effect on later calls"
        )
    _drop_concrete_arg_asserts(gm, concrete)
    input_names = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            target = node.target.lstrip("*")
            input_names.append(target if target in arguments else target.rsplit("_", 1)[0])
    return gm, input_names, tracer


class _ModuleState:
    """The attributes of a module and of every submodule (`__dict__`, parameters, buffers,
    children), to put back after tracing: traced code runs the forward's Python, so
    `self.count += 1` or `self.cache = x` would otherwise leave proxies and counts behind,
    and fx stores tensor constants on the root."""

    def __init__(self, module: nn.Module):
        self.saved = [
            (name, m, dict(m.__dict__), {k: dict(getattr(m, k)) for k in self._DICTS})
            for name, m in module.named_modules(remove_duplicate=True)
        ]

    _DICTS = ("_parameters", "_buffers", "_modules")

    def restore(self) -> list[tuple[str, Any]]:
        """Put every attribute back; return (qualified name, assigned value) of each attribute
        the forward assigned (fx's own tensor constants on the root excluded)."""
        changed: list[tuple[str, Any]] = []
        for prefix, m, attrs, dicts in self.saved:
            now = dict(m.__dict__)
            for k in self._DICTS:
                now.update({f"{k}:{n}": v for n, v in getattr(m, k).items()})
            before = dict(attrs)
            for k, d in dicts.items():
                before.update({f"{k}:{n}": v for n, v in d.items()})
            for key, value in now.items():
                if key in self._DICTS or (key in before and before[key] is value):
                    continue
                if not prefix and key.startswith("_tensor_constant"):
                    continue
                name = key.split(":")[-1]
                changed.append((f"{prefix}.{name}" if prefix else name, value))
            m.__dict__.clear()
            m.__dict__.update(attrs)
            for k, d in dicts.items():
                getattr(m, k).clear()
                getattr(m, k).update(d)
                m.__dict__[k] = getattr(m, k)
        return changed


def _drop_concrete_arg_asserts(gm: fx.GraphModule, concrete: dict[str, Any]) -> None:
    """fx adds `assert arg is None` / `assert arg == value` nodes for concrete args; the
    cache key already guarantees them, and they would only clutter the IR."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    concrete_targets = {f"{name}_1" for name in concrete}
    for node in list(gm.graph.nodes):
        if node.op == "placeholder" and node.target in concrete_targets:
            stack = list(node.users)
            doomed: list[fx.Node] = []
            while stack:
                user = stack.pop()
                if user not in doomed:
                    doomed.append(user)
                    stack.extend(user.users)
            for user in sorted(doomed, key=lambda n: -position[n]):
                gm.graph.erase_node(user)
    gm.recompile()


# ---------------------------------------------------------------------------------------
# Profiling: what each node allocates, saves and costs
# ---------------------------------------------------------------------------------------


class _FakeLiveBytes(TorchDispatchMode):
    """Live bytes of the storages that fake ops create while active: `MemoryTracker`'s rule
    (an op output whose storage is not one of the op's inputs' is new memory) for fake
    tensors, whose storage objects PyTorch does not keep alive, so a storage counts as live
    while a tensor on it does."""

    def __init__(self, known: set[int]):
        super().__init__()
        self.known = set(known)
        self.live = 0
        self.peak = 0
        self.ops = 0  # ops seen so far
        self.created: dict[int, int] = {}  # storage key -> index of the op that made it
        self._tensors: dict[int, list[int]] = {}  # storage key -> [bytes, live tensors]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        input_keys = {_storage_key(t) for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            key = _storage_key(t)
            if key is None or key in self.known:
                continue
            entry = self._tensors.get(key)
            if entry is None:
                if key in input_keys:
                    continue
                entry = self._tensors[key] = [t.untyped_storage().nbytes(), 0]
                self.live += entry[0]
                self.created.setdefault(key, self.ops)
            entry[1] += 1
            weakref.finalize(t, self._release, key)
        self.peak = max(self.peak, self.live)
        self.ops += 1
        return out

    def will_free(self, tensors: list[torch.Tensor]) -> None:
        """Count the storages of these tensors, made before this mode, as freed (negative live
        bytes) when the last of them dies: a composite op's backward (an RNN's, a leaf
        module's) frees what its forward saved step by step, and its net growth is what
        comes on top of the saved bytes the IR already charges."""
        for t in tensors:
            key = _storage_key(t)
            if key is None or key in self.known:
                continue
            entry = self._tensors.setdefault(key, [t.untyped_storage().nbytes(), 0])
            entry[1] += 1
            weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._tensors.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                del self._tensors[key]
                self.live -= entry[0]


@dataclass
class _Profile:
    output: Any
    output_bytes: int
    alias_of: str | None
    requires_grad: bool
    saved_inputs: tuple[str, ...]
    saves_output: bool
    saved_extra_bytes: int
    flops: float
    mutated_inputs: tuple[str, ...]
    forward_peak_bytes: int = 0  # most new bytes live at once while the node runs forward
    backward_peak_bytes: int = 0  # most new bytes live at once while its backward runs
    backward_flops: float = 0.0
    grad_passthrough: list[str] = field(default_factory=list)  # inputs given the output's grad
    value_bytes: int = 0  # numel x element size of the output tensors (their gradients' size)
    # Non-reentrant checkpoint's early stop ends a recompute at the last saved tensor: what
    # of this node would then not run (inputs are saved before an op runs, outputs after).
    flops_after_last_save: float = 0.0
    output_after_last_save: bool = False


def _leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.requires_grad:
        return x.detach().requires_grad_(True)
    return x


def _profile_call(
    run: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    inputs: list[tuple[str, Any]],
    persistent_keys: set[int],
    owners: dict[int, str],
    name: str = "",
    params: tuple[torch.Tensor, ...] = (),
    gradient_view_of: str | None = None,
) -> _Profile:
    """Run `run(*args, **kwargs)` (its inputs are `inputs`: (IR name, value)) on detached
    copies of its inputs, and classify its memory; then run its backward (FLOPs, peak bytes).

    persistent_keys: storages of parameters, buffers and constants (never charged).
    owners: storage key -> IR name of the node that created it; new storages are added
        under `name`.
    params: (fake) parameters `run` uses, for the backward.
    gradient_view_of: the input of a view op whose backward views the output's gradient
        (`_gradient_view_input`): when the output aliases it, the backward is not run.
    """
    input_keys: dict[int, str] = {}
    versions = []
    for input_name, value in inputs:
        for t in _tensors(value):
            key = _storage_key(t)
            if key is not None:
                input_keys.setdefault(key, input_name)
            versions.append((input_name, t, t._version))
    leaves = tree_map(_leaf, (args, kwargs))
    saved: list[torch.Tensor] = []

    counters: dict[str, Any] = {}
    last_save = [0.0, 0]  # FLOPs and ops done when the last tensor was saved

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        last_save[:] = [counters["flops"].get_total_flops(), counters["memory"].ops]
        return t

    def forward(call_args, call_kwargs):
        saved.clear()
        known = persistent_keys | set(input_keys) | set(owners)
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with hooks, TotalFlopCounterMode() as fc, _RealStorageSizes() as real:
            with _FakeLiveBytes(known) as memory:
                counters.update(flops=fc, memory=memory)
                out = run(*call_args, **call_kwargs)
        return out, fc, real, memory

    try:  # on leaves: the backward below then stops at this node's inputs
        output, fc, real, memory = forward(*leaves)
        detached = True
    except RuntimeError:  # an in-place op on an input that requires grad: not on a leaf
        output, fc, real, memory = forward(args, kwargs)
        detached = False
    mutated = tuple(dict.fromkeys(n for n, t, v in versions if t._version != v))

    output_bytes, alias_of, output_keys = 0, None, set()
    for t in _tensors(output):
        key = _storage_key(t)
        if key is None:
            continue
        output_keys.add(key)
        if key in input_keys:
            alias_of = alias_of or input_keys[key]
        elif key not in persistent_keys and key not in owners:
            output_bytes += real.sizes.get(key, t.untyped_storage().nbytes())
            owners[key] = name
    saved_inputs: list[str] = []
    saves_output = False
    extra: dict[int, int] = {}
    for t in saved:
        key = _storage_key(t)
        if key is None or key in persistent_keys:
            continue
        if key in input_keys:
            if input_keys[key] not in saved_inputs:
                saved_inputs.append(input_keys[key])
        elif key in output_keys:
            saves_output = True
        else:
            extra[key] = t.untyped_storage().nbytes()
    after_last_save = bool(saved) and any(
        memory.created.get(key, -1) >= last_save[1] for key in output_keys
    )
    flops_after_last_save = float(fc.get_total_flops()) - last_save[0] if saved else 0.0
    saved_extra = [t for t in saved if _storage_key(t) in extra]
    saved.clear()
    profile = _Profile(
        output=output,
        output_bytes=output_bytes,
        alias_of=alias_of,
        requires_grad=_requires_grad(output),
        saved_inputs=tuple(saved_inputs),
        saves_output=saves_output,
        saved_extra_bytes=sum(extra.values()),
        flops=float(fc.get_total_flops()),
        mutated_inputs=mutated,
        forward_peak_bytes=memory.peak,
        flops_after_last_save=flops_after_last_save,
        output_after_last_save=after_last_save,
        value_bytes=sum(t.numel() * t.element_size() for t in _tensors(output)),
    )
    if detached and not mutated and profile.requires_grad:
        if gradient_view_of is not None and alias_of == gradient_view_of and not profile.flops:
            profile.grad_passthrough.append(gradient_view_of)  # what the backward would find
        else:
            _profile_backward(profile, output, leaves, inputs, params, persistent_keys, saved_extra)
    saved_extra.clear()
    return profile


def _profile_backward(
    profile, output, leaves, inputs, params, persistent_keys, saved_extra: list
) -> None:
    """Backpropagate through one node alone (its inputs are leaves): FLOPs and peak bytes
    (net of the node's own saved tensors, `saved_extra`, that its backward frees as it runs;
    the list is emptied so that autograd holds the last references)."""
    outs = [t for t in _tensors(output) if t.requires_grad]
    names = {}
    for input_name, value in inputs:
        for t in _tensors(value):
            names.setdefault(_storage_key(t), input_name)
    wrt = [t for t in _tensors(leaves) if t.requires_grad]
    wrt += [p for p in params if p.requires_grad]
    if not outs or not wrt:
        return
    grad_outputs = [torch.ones_like(t) for t in outs]
    known = persistent_keys | {_storage_key(t) for t in (*outs, *grad_outputs, *wrt)}
    memory = _FakeLiveBytes(known)
    memory.will_free(saved_extra)
    saved_extra.clear()
    try:
        with TotalFlopCounterMode() as fc, memory:
            grads = torch.autograd.grad(outs, wrt, grad_outputs, allow_unused=True)
    except RuntimeError:  # no backward formula on fake tensors: the IR's defaults apply
        return
    profile.backward_flops = float(fc.get_total_flops())
    profile.backward_peak_bytes = memory.peak
    out_grad_keys = {_storage_key(g) for g in grad_outputs}
    for t, g in zip(wrt, grads):
        input_name = names.get(_storage_key(t))
        if g is not None and input_name is not None:
            if _storage_key(g) in out_grad_keys:  # add, views, ...: the gradient passes through
                profile.grad_passthrough.append(input_name)


def _charge_param_grads(nodes: list[Node], params_used: list[list[nn.Parameter]]) -> None:
    """Each trainable parameter's gradient is charged to its last forward user."""
    last_user: dict[int, tuple[int, nn.Parameter]] = {}
    for i, params in enumerate(params_used):
        for p in params:
            if p.requires_grad:
                last_user[id(p)] = (i, p)
    for i, p in last_user.values():
        nodes[i].param_grad_bytes += p.numel() * p.element_size()


def _module_label(node: fx.Node) -> str:
    if node.op == "call_module":
        return node.target
    if "hbp_module" in node.meta:
        return node.meta["hbp_module"]
    stack = node.meta.get("nn_module_stack")
    if stack:
        return next(reversed(stack.values()))[0]
    return ""


def _op_label(node: fx.Node, root: nn.Module) -> str:
    if node.op == "placeholder":
        return "input"
    if node.op == "call_module":
        return type(root.get_submodule(node.target)).__name__
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    return getattr(node.target, "__name__", str(node.target))


def _capture_ops(
    module: nn.Module, arguments: dict[str, Any], signature: inspect.Signature
) -> CapturedGraph:
    faker = _Faker()
    gm, input_names, tracer = _trace(module, arguments, signature, faker)
    captured = _profile_graph(gm, module, arguments, input_names, signature, faker)
    captured.output_template = tracer.output_template
    captured.inlined_checkpoints = tracer.inlined_checkpoints
    return captured


def _profile_graph(
    gm: fx.GraphModule,
    module: nn.Module,
    arguments: dict[str, Any],
    input_names: list[str],
    signature: inspect.Signature,
    faker: _Faker,
) -> CapturedGraph:
    """Run every node of `gm` on fake values and build the IR. An in-place op that can be
    made out of place (`_out_of_place`) is, right after it ran, and is run again so."""
    persistent = [faker.tensor(t) for t in (*module.parameters(), *module.buffers())]
    persistent += [faker.tensor(t) for t in (*gm.parameters(), *gm.buffers())]
    persistent_keys = {k for k in map(_storage_key, persistent) if k is not None}

    values: dict[fx.Node, Any] = {}
    owners: dict[int, str] = {}
    nodes: list[Node] = []
    fx_nodes: list[fx.Node] = []
    params_used: list[list[nn.Parameter]] = []
    mutated_inputs: dict[str, tuple[str, ...]] = {}
    mutated_attrs: dict[str, tuple[str, ...]] = {}
    profiles: dict[str, _Profile] = {}
    placeholders = iter(input_names)
    outputs: list[str] = []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_name: dict[str, Node] = {}
    changed = False

    for node in gm.graph.nodes:
        if node.op == "output":
            outputs = list(
                dict.fromkeys(n.name for n in node.all_input_nodes if n.op != "get_attr")
            )
        elif node.op == "get_attr":
            values[node] = faker.tree(_fetch_attr(gm, node.target))
        elif node.op == "placeholder":
            name = next(placeholders)
            values[node] = faker.tree(arguments[name], fresh=True)
            nodes.append(_input_node(node.name, values[node], owners, persistent_keys))
            fx_nodes.append(node)
            params_used.append([])
        else:
            ir_node, params, profiles[node.name], attrs = _profile_fx_node(
                node, gm, faker, values, owners, persistent_keys
            )
            if not _mutates_persistent(node, profiles[node.name], values, persistent_keys) and (
                _out_of_place(node, ir_node, profiles[node.name], gm, by_name, fx_nodes, order)
            ):
                changed = True
                for key in [k for k, owner in owners.items() if owner == node.name]:
                    del owners[key]
                ir_node, params, profiles[node.name], attrs = _profile_fx_node(
                    node, gm, faker, values, owners, persistent_keys
                )
            if profiles[node.name].mutated_inputs:
                mutated_inputs[node.name] = profiles[node.name].mutated_inputs
            if attrs:
                mutated_attrs[node.name] = attrs
            nodes.append(ir_node)
            fx_nodes.append(node)
            params_used.append(params)
        if fx_nodes and fx_nodes[-1] is node:
            by_name[node.name] = nodes[-1]

    if changed:
        gm.graph.lint()
        gm.recompile()
    _charge_param_grads(nodes, params_used)
    graph = Graph(
        nodes,
        outputs,
        meta={"framework": "torch", "granularity": OP, "fx_nodes": len(gm.graph.nodes)},
    )
    _record_transients(graph, profiles)
    return CapturedGraph(
        graph=graph,
        gm=gm,
        granularity=OP,
        fx_nodes=fx_nodes,
        input_names=input_names,
        signature=signature,
        mutated_inputs=mutated_inputs,
        mutated_attrs=mutated_attrs,
    )


# In-place ops whose out-of-place form is not `x = x.op(...)` (random fills, copies, resizes).
_NOT_FUNCTIONAL = set(
    "bernoulli_ cauchy_ copy_ detach_ exponential_ fill_ geometric_ log_normal_ normal_ "
    "random_ requires_grad_ resize_ resize_as_ set_ share_memory_ uniform_ zero_".split()
)

# Leaf activation/dropout modules with `inplace=True` -> (functional form, its arguments).
_INPLACE_MODULES: dict[type, Callable[[nn.Module], tuple[Callable, dict]]] = {
    nn.ReLU: lambda m: (F.relu, {}),
    nn.ReLU6: lambda m: (F.relu6, {}),
    nn.SiLU: lambda m: (F.silu, {}),
    nn.Mish: lambda m: (F.mish, {}),
    nn.SELU: lambda m: (F.selu, {}),
    nn.Hardswish: lambda m: (F.hardswish, {}),
    nn.Hardsigmoid: lambda m: (F.hardsigmoid, {}),
    nn.LeakyReLU: lambda m: (F.leaky_relu, {"negative_slope": m.negative_slope}),
    nn.ELU: lambda m: (F.elu, {"alpha": m.alpha}),
    nn.CELU: lambda m: (F.celu, {"alpha": m.alpha}),
    nn.Hardtanh: lambda m: (F.hardtanh, {"min_val": m.min_val, "max_val": m.max_val}),
    nn.Threshold: lambda m: (F.threshold, {"threshold": m.threshold, "value": m.value}),
    nn.Dropout: lambda m: (F.dropout, {"p": m.p, "training": m.training}),
    nn.Dropout1d: lambda m: (F.dropout1d, {"p": m.p, "training": m.training}),
    nn.Dropout2d: lambda m: (F.dropout2d, {"p": m.p, "training": m.training}),
    nn.Dropout3d: lambda m: (F.dropout3d, {"p": m.p, "training": m.training}),
    nn.AlphaDropout: lambda m: (F.alpha_dropout, {"p": m.p, "training": m.training}),
}


def _mutates_persistent(
    node: fx.Node, profile: _Profile, values: dict[fx.Node, Any], persistent_keys: set[int]
) -> bool:
    """Whether `node` mutates (a view of) a parameter, buffer or constant in place: such an
    update is the point of the op (`self.running.mul_(0.9).add_(x)`) and must stay in place."""
    mutated = set(profile.mutated_inputs)
    return any(
        _storage_key(t) in persistent_keys
        for src in node.all_input_nodes
        if src.name in mutated
        for t in _tensors(values.get(src))
    )


def _out_of_place(
    node: fx.Node,
    ir_node: Node,
    profile: _Profile,
    gm: fx.GraphModule,
    by_name: dict[str, Node],
    earlier: list[fx.Node],
    order: dict[fx.Node, int],
) -> bool:
    """Make the in-place op `node` out of place where that cannot change any value the
    program reads; return whether it did (the fx graph changed, `node` must run again).

    An in-place op at a segment boundary would have to be recomputed from its already
    mutated input (the executor then clones the input: memory the plan did not predict). Out
    of place, the op allocates its own output, which the IR models exactly; the old value dies
    as soon as nothing reads it (in-place activations after BatchNorm: right away). Only done
    when the op mutates one value, that value is not (a view of) a graph input, and no other
    view of its storage made before the op (`earlier`: the nodes profiled so far, with their
    IR nodes in `by_name`) is read after it; later readers of the mutated value are
    redirected to the op's result."""
    mutated = profile.mutated_inputs
    if len(mutated) != 1 or ir_node.alias_of != mutated[0]:
        return False

    def root(name: str) -> str:
        while by_name[name].alias_of:
            name = by_name[name].alias_of
        return name

    value = next(n for n in node.all_input_nodes if n.name == mutated[0])
    if value.op == "placeholder" or by_name[root(value.name)].is_input:
        return False
    base = root(value.name)
    for other in earlier:
        if other is value or root(other.name) != base:
            continue
        if any(order[user] > order[node] for user in other.users):
            return False  # another view of the storage is read afterwards: it must see the change
    if not _make_out_of_place(node, gm):
        return False
    for user in list(value.users):
        if user is not node and order[user] > order[node]:
            user.replace_input_with(value, node)
    return True


def _make_out_of_place(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op == "call_method":
        name = node.target
        functional = name[:-1]
        if name.endswith("__") or not name.endswith("_") or name in _NOT_FUNCTIONAL:
            return False
        if not callable(getattr(torch.Tensor, functional, None)):
            return False
        node.target = functional
        return True
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        make = _INPLACE_MODULES.get(type(module))
        if make is None or not getattr(module, "inplace", False):
            return False
        fn, kwargs = make(module)
        node.meta["hbp_module"] = node.target
        node.op, node.target = "call_function", fn
        node.kwargs = {**node.kwargs, **kwargs}
        return True
    if node.op == "call_function":
        fn = node.target
        name = getattr(fn, "__name__", "")
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}
        if "inplace" in params:
            bound = inspect.signature(fn).bind(*node.args, **node.kwargs)
            if bound.arguments.get("inplace") is not True:
                return False
            bound.arguments["inplace"] = False
            node.args, node.kwargs = bound.args, bound.kwargs
            return True
        functional = getattr(torch, name[:-1], None) if name.endswith("_") else None
        if functional is None or name in _NOT_FUNCTIONAL or fn is not getattr(torch, name, None):
            return False
        node.target = functional
        return True
    return False


def _record_transients(graph: Graph, profiles: dict[str, _Profile]) -> None:
    """Memory facts measured while profiling, onto the nodes' fields (`hbp.graph.ir.Node`;
    `hbp.analysis.liveness` reads them):

    - `grad_bytes`: a gradient has its value's size (numel x element size), which differs from
      the output's new storage for views and in-place results (0 new bytes, a full-size
      gradient) and where a CPU loss kernel returns a scalar view of an unreduced buffer.
    - `grad_passthrough`: inputs whose gradient is the node's output gradient itself (add,
      views: backward allocates nothing for them).
    - `forward_scratch_bytes` / `backward_scratch_bytes`: bytes a node holds only while its
      forward / backward runs, beyond what the event accounting already charges there: scratch
      inside composite ops (chunked logits, a leaf module's intermediates; in backward,
      intermediate gradients such as cross-entropy's log-softmax gradient). Kernel workspace
      no tensor holds is added by `hbp.graph.calibrate_scratch`.
    - `flops_after_last_save` / `output_after_last_save`: what of a node does not run when a
      recompute pass early-stops at it (torch saves an op's inputs before the op runs and its
      outputs after): the FLOPs after its last saved tensor, and whether its output storage
      is allocated after it (a Linear that saves only its input: the matmul and its output).
    """
    for node in graph.nodes:
        prof = profiles.get(node.name)
        if prof is not None and node.requires_grad and prof.value_bytes != node.output_bytes:
            node.grad_bytes = prof.value_bytes
    for node in graph.nodes:
        prof = profiles.get(node.name)
        if prof is None:
            continue
        node.grad_passthrough = tuple(prof.grad_passthrough)
        node.flops_after_last_save = prof.flops_after_last_save
        node.output_after_last_save = bool(prof.output_after_last_save)
        node.forward_scratch_bytes = max(
            0, prof.forward_peak_bytes - node.output_bytes - node.saved_extra_bytes
        )
        modelled = node.param_grad_bytes + sum(
            graph.node(i).gradient_bytes
            for i in dict.fromkeys(node.inputs)
            if i not in prof.grad_passthrough
        )
        node.backward_scratch_bytes = max(0, prof.backward_peak_bytes - modelled)


def _input_node(name: str, value: Any, owners: dict[int, str], persistent_keys: set[int]) -> Node:
    """The IR node of a graph input: its tensors' storages are allocated before the step."""
    nbytes = 0
    for t in _tensors(value):
        key = _storage_key(t)
        if key is not None and key not in owners and key not in persistent_keys:
            owners[key] = name
            nbytes += t.untyped_storage().nbytes()
    return Node(
        name=name,
        op="input",
        output_bytes=nbytes,
        requires_grad=_requires_grad(value),
        is_input=True,
    )


# View ops whose backward is a view of the output's gradient (no FLOPs, no new memory): their
# gradient passes through to their input, which profiling their backward would only confirm.
_GRAD_VIEW_METHODS = set(
    "view reshape transpose permute t unsqueeze squeeze flatten unflatten contiguous "
    "swapaxes movedim".split()
)
_GRAD_VIEW_FUNCTIONS = {
    torch.transpose,
    torch.reshape,
    torch.flatten,
    torch.unsqueeze,
    torch.squeeze,
    torch.permute,
    torch.t,
    torch.swapaxes,
    torch.movedim,
}


def _gradient_view_input(node: fx.Node, values: dict[fx.Node, Any]) -> str | None:
    """The input of `node` if it is such a view op (or picks an element of a tuple/list)."""
    src = node.args[0] if node.args else None
    if not isinstance(src, fx.Node):
        return None
    value = values.get(src)
    if node.op == "call_function" and node.target is operator.getitem:
        ok = isinstance(value, (tuple, list)) and isinstance(node.args[1], int)
    else:
        ok = isinstance(value, torch.Tensor) and (
            (node.op == "call_method" and node.target in _GRAD_VIEW_METHODS)
            or (node.op == "call_function" and node.target in _GRAD_VIEW_FUNCTIONS)
        )
    return src.name if ok else None


def _profile_fx_node(
    node: fx.Node,
    gm: fx.GraphModule,
    faker: _Faker,
    values: dict[fx.Node, Any],
    owners: dict[int, str],
    persistent_keys: set[int],
) -> tuple[Node, list[nn.Parameter], _Profile, tuple[str, ...]]:
    """Run one fx node on fake values; return its IR node, the parameters it uses, its
    profile and the attributes (buffers) it mutates in place."""
    ir_inputs = [n for n in node.all_input_nodes if n.op != "get_attr"]
    attr_inputs = [n for n in node.all_input_nodes if n.op == "get_attr"]
    state: list[tuple[str, torch.Tensor]] = [
        (n.target, t) for n in attr_inputs for t in _tensors(_fetch_attr(gm, n.target))
    ]
    guarded: set[int] = set()
    if node.op == "call_module":
        sub = gm.get_submodule(node.target)
        state += [(f"{node.target}.{k}", v) for k, v in sub.named_parameters()]
        state += [(f"{node.target}.{k}", v) for k, v in sub.named_buffers()]
        guarded = {id(b) for m in stat_tracking_norms(sub) for b in m.buffers()}
    params = list({id(p): p for _, p in state if isinstance(p, nn.Parameter)}.values())
    buffer_versions = [
        (k, b, faker.tensor(b)._version) for k, b in state if not isinstance(b, nn.Parameter)
    ]
    args, kwargs = fx.node.map_aggregate(
        (node.args, node.kwargs), lambda a: values[a] if isinstance(a, fx.Node) else a
    )
    with faker.mode:
        prof = _profile_call(
            lambda *a, **k: _run_fx_node(node, gm, faker, a, k),
            args,
            kwargs,
            [(n.name, values[n]) for n in ir_inputs],
            persistent_keys,
            owners,
            node.name,
            tuple(faker.tensor(p) for p in params),
            _gradient_view_input(node, values),
        )
    values[node] = prof.output
    mutated_attrs = tuple(
        dict.fromkeys(
            k
            for k, b, v in buffer_versions
            if faker.tensor(b)._version != v and id(b) not in guarded
        )
    )
    ir_node = Node(
        name=node.name,
        op=_op_label(node, gm),
        inputs=tuple(n.name for n in ir_inputs),
        output_bytes=prof.output_bytes,
        flops=prof.flops,
        backward_flops=prof.backward_flops,
        requires_grad=prof.requires_grad,
        saved_inputs=prof.saved_inputs,
        saves_output=prof.saves_output,
        saved_extra_bytes=prof.saved_extra_bytes,
        alias_of=prof.alias_of,
        module=_module_label(node),
    )
    return ir_node, params, prof, mutated_attrs


# ---------------------------------------------------------------------------------------
# Fallback: module-level cut points
# ---------------------------------------------------------------------------------------


@dataclass
class _Call:
    path: str
    occurrence: int
    module: nn.Module
    args: tuple
    kwargs: dict
    output: Any


def _record_calls(
    module: nn.Module, bound: inspect.BoundArguments, faker: _Faker | None
) -> tuple[list[_Call], list[tuple[str, int, int, int, tuple[int, ...]]]]:
    """The top-level child module calls of one forward (nn.Sequential calls expanded into
    their children's calls), with their inputs and outputs, and the expanded Sequential
    calls (`_expand_sequential`)."""
    paths = {m: p for p, m in module.named_modules() if p}
    depth = [0]
    calls: list[tuple[int, _Call]] = []
    counts: dict[str, int] = {}

    def pre_hook(mod, args, kwargs):
        depth[0] += 1

    def post_hook(mod, args, kwargs, output):
        depth[0] -= 1
        path = paths[mod]
        counts[path] = counts.get(path, 0) + 1
        calls.append((depth[0], _Call(path, counts[path] - 1, mod, args, kwargs, output)))

    handles = []
    for mod in paths:
        handles.append(mod.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(mod.register_forward_hook(post_hook, with_kwargs=True))
    state = _ModuleState(module)  # the forward's Python side effects are undone after
    try:
        if faker is None:
            with _buffers_restored(module):
                module.forward(*bound.args, **bound.kwargs)
        else:
            args, kwargs = faker.tree((bound.args, bound.kwargs), fresh=True)
            with faker.mode:
                _call_module(faker, module, args, kwargs)
    finally:
        for h in handles:
            h.remove()
        state.restore()
    # `calls` is in completion order (children before their parent).
    out: list[_Call] = []
    groups: list[tuple[str, int, int, int, tuple[int, ...]]] = []
    _expand_sequential(calls, 0, out, groups)
    return out, groups


@contextlib.contextmanager
def _buffers_restored(module: nn.Module) -> Iterator[None]:
    """Inside, a real forward may update buffers in place (running means, step counters);
    their values before are put back on exit."""
    saved = [(b, b.clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def _expand_sequential(
    calls: list[tuple[int, _Call]],
    level: int,
    out: list[_Call],
    groups: list[tuple[str, int, int, int, tuple[int, ...]]],
) -> list[int]:
    """Append to `out` the calls at `level`, each nn.Sequential call replaced by its
    children's calls (recursively), and return where each call at `level` starts in `out`.
    For each replaced call append to `groups` (path, occurrence, first, end, where each
    direct child starts) in `out` positions: a Sequential's children form a chain with no
    other code between them, so any run of them can be checkpointed as one function."""
    starts: list[int] = []
    pending: list[tuple[int, _Call]] = []
    for d, call in calls:
        if d > level:
            pending.append((d, call))
            continue
        if d == level:
            starts.append(len(out))
            if type(call.module).forward is nn.Sequential.forward and pending:
                first = len(out)
                children = _expand_sequential(pending, level + 1, out, groups)
                groups.append((call.path, call.occurrence, first, len(out), tuple(children)))
            else:
                out.append(call)
            pending = []
    return starts


def _capture_modules(
    module: nn.Module, bound: inspect.BoundArguments, signature: inspect.Signature, reason: str
) -> CapturedGraph:
    norms = stat_tracking_norms(module)
    faker = _Faker()
    try:
        calls, groups = _record_calls(module, bound, faker)
        recorded_fake = True
    except Exception:  # noqa: BLE001 - data-dependent Python: record a real no-grad run
        with torch.no_grad(), frozen_running_stats(norms):
            calls, groups = _record_calls(module, bound, None)
        recorded_fake = False
    if not calls:
        raise RuntimeError(
            f"hbp cannot capture {type(module).__name__}: op-level capture failed ({reason}) "
            "and its forward calls no child modules to cut at"
        )
    real_inputs = _tensors((bound.args, bound.kwargs))
    input_requires_grad = any(t.requires_grad for t in real_inputs)
    nodes = [
        Node(
            name="input",
            op="input",
            output_bytes=sum(t.untyped_storage().nbytes() for t in real_inputs),
            requires_grad=input_requires_grad,
            is_input=True,
        )
    ]
    params_used: list[list[nn.Parameter]] = [[]]
    profiles: dict[str, _Profile] = {}
    upstream_requires_grad = input_requires_grad
    prev = "input"
    for call in calls:
        prof = _profile_module_call(call, faker, recorded_fake, norms, upstream_requires_grad)
        upstream_requires_grad = upstream_requires_grad or any(
            p.requires_grad for p in call.module.parameters()
        )
        name = f"{call.path.replace('.', '_')}_{call.occurrence}"
        profiles[name] = prof
        nodes.append(
            Node(
                name=name,
                op=type(call.module).__name__,
                inputs=(prev,),
                output_bytes=prof.output_bytes,
                flops=prof.flops,
                backward_flops=prof.backward_flops,
                requires_grad=prof.requires_grad,
                saved_inputs=(prev,) if prof.saved_inputs else (),
                saves_output=prof.saves_output,
                saved_extra_bytes=prof.saved_extra_bytes,
                alias_of=prev if prof.alias_of else None,
                module=call.path,
            )
        )
        params_used.append(list(call.module.parameters()))
        prev = name
    _charge_param_grads(nodes, params_used)
    graph = Graph(
        nodes,
        [prev],
        meta={"framework": "torch", "granularity": MODULE, "fallback_reason": reason},
    )
    _record_transients(graph, profiles)
    return CapturedGraph(
        graph=graph,
        gm=None,
        granularity=MODULE,
        input_names=list(bound.arguments),
        signature=signature,
        module_calls=[(c.path, c.occurrence) for c in calls],
        module_groups=[
            (path, k, first + 1, end + 1, tuple(c + 1 for c in children))
            for path, k, first, end, children in groups
        ],
        fallback_reason=reason,
    )


def _profile_module_call(
    call: _Call, faker: _Faker, recorded_fake: bool, norms, upstream_requires_grad: bool
) -> _Profile:
    """Profile one recorded child call in isolation on fake copies of its recorded inputs
    (real ones if the child itself cannot run on fake tensors)."""

    def leaf_inputs(convert):
        def leaf(x):
            if not isinstance(x, torch.Tensor):
                return x
            y = convert(x.detach())
            if y.is_floating_point() and (x.requires_grad or upstream_requires_grad):
                y = y.requires_grad_(True)
            return y

        return tree_map(leaf, (call.args, call.kwargs))

    state = (*call.module.parameters(), *call.module.buffers())
    try:
        with faker.mode:
            args, kwargs = leaf_inputs(faker.fresh)
            return _profile_call(
                lambda *a, **k: _call_module(faker, call.module, a, k),
                args,
                kwargs,
                [("in", (args, kwargs))],
                {_storage_key(faker.tensor(t)) for t in state},
                {},
                params=tuple(faker.tensor(p) for p in call.module.parameters()),
            )
    except Exception:  # noqa: BLE001 - a data-dependent child: profile it for real
        if recorded_fake:
            raise
        with frozen_running_stats(norms), _rng_preserved(call.module, {}):
            args, kwargs = leaf_inputs(lambda x: x.clone())
            return _profile_call(
                call.module.forward,
                args,
                kwargs,
                [("in", (args, kwargs))],
                {_storage_key(t) for t in state},
                {},
                params=tuple(call.module.parameters()),
            )


@contextlib.contextmanager
def _rng_preserved(module: nn.Module, arguments: dict) -> Iterator[None]:
    """Restore the CPU RNG (and that of every CUDA device in use) on exit."""
    tensors = _tensors(arguments) + list(module.parameters())
    devices = sorted({t.device.index or 0 for t in tensors if t.is_cuda})
    with torch.random.fork_rng(devices=devices):
        yield
