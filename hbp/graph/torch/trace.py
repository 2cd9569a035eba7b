"""Trace stage, first try: torch.fx symbolic tracing specialised to the input signature.

Why torch.fx symbolic tracing first: the executor must run the *user's own modules and
parameters* eagerly, so that a recomputed segment re-runs exactly the code the plain model
runs (same kernels, same dropout draws, same BatchNorm buffers, same tied `Parameter` objects
receiving `.grad`). `torch.fx` keeps nn.Module leaves (Linear, Conv2d, BatchNorm2d, Dropout,
...) as `call_module` nodes that call the real submodule, and the `GraphModule` holds the very
same parameter objects. Where it fails (decorated forwards, `**kwargs`, `torch.is_tensor` on
arguments: real models), the export stage (`hbp.graph.torch.export`) runs the forward's Python
on fake tensors instead.

Two refinements over plain `torch.fx.symbolic_trace`:
- Shape specialisation. Capture is per input signature (HCModule caches per signature), so
  every proxy carries the fake value of its node, and `x.size()`, `x.shape`, `x.dim()`,
  `x.dtype`, `x.device`, `len(x)` return concrete values. Shape asserts and shape-dependent
  Python (`b, t = idx.size(); assert t <= block_size`) trace; data-dependent control flow
  (`if x.sum() > 0`) still fails, as it must. Tensor factories (`torch.arange`, `torch.rand`,
  `torch.zeros`, ...) are recorded as graph nodes even when all their arguments are concrete,
  so random draws are not baked into the graph as constants.
- None-valued and scalar (bool/int/float/str) keyword arguments are `concrete_args`.

Forward code that assigns module attributes: a traced value assigned to a registered buffer
(`self.count += 1`, `self.ema = 0.9 * self.ema + ...`) is recorded as `buffer.copy_(value)`,
so every call updates it; in-place updates of buffers (`self.running.mul_(0.9)`) stay in
place. Assigning a Python value (`self.calls += 1`) is a side effect a graph cannot repeat:
op-level capture fails and hbp falls back to module level, which runs the forward itself.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.fx._symbolic_trace import HAS_VARSTUFF
from torch.utils._pytree import tree_map

from hbp.graph.torch.breaks import DATA_DEPENDENT, REAL_RESULTS, record_real_results
from hbp.graph.torch.fake import MISSING, Faker, MadeOutputs, fetch_attr, run_fx_node
from hbp.graph.torch.modes import MODES, ambient_modes
from hbp.graph.torch.outputs import OutputSlot, map_output
from hbp.graph.torch.proxy import ValueProxy
from hbp.graph.torch.state import ForwardSideEffect, ModuleState

# Tensor factories recorded as graph nodes even with concrete arguments (see module docstring).
_FACTORIES = (
    "arange empty empty_strided eye full linspace logspace normal ones rand randint randn "
    "randperm scalar_tensor tensor tril_indices triu_indices zeros"
).split()


#: Libraries whose own forward hooks are part of their models (transformers collects
#: hidden states and attentions with them): not the user's hooks.
LIBRARY_HOOKS = ("transformers.", "diffusers.", "timm.", "torchvision.")


def user_hooks(module: nn.Module) -> list:
    """The forward (pre-)hooks on `module` that its library did not install itself."""
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    return [h for h in hooks if not getattr(h, "__module__", "").startswith(LIBRARY_HOOKS)]


def hooked_submodules(module: nn.Module) -> list[str]:
    """The paths of `module`'s submodules (not itself) with forward hooks of the user's."""
    return [name for name, m in module.named_modules() if name and user_hooks(m)]


# NOTE [ A module with forward hooks is one node ]
# Traced through, a submodule's forward hooks ran once, at capture, on the tracer's values:
# a hook that stores a block's output for an auxiliary loss (feature distillation, probing)
# stored a proxy at the first step and nothing at the later ones, which run the captured
# graph (a Bloom: a TypeError, then a KeyError; a new-user trial). A submodule with hooks of
# the user's (not its library's own) is kept as one node of the graph, called through
# nn.Module's call at every step: its hooks see the real tensors, and what they return is the
# module's output. The plan cuts around the node, not inside it; a recompute of the node runs
# its hooks again. The export tracer cannot keep a module whole: it refuses a module with
# such hooks (they ran on its fake tensors: a UNet's caller computed its loss, and got its
# parameters' .grad, as fake tensors), and the step is captured at module level, whose calls
# run the hooks.


# torch.nn modules traced through rather than kept as leaves (see `_Tracer.is_leaf_module`).
_TRACED_TORCH_NN = (
    nn.Transformer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)


# NOTE [ Decorated forwards ]
# fx reads a forward's parameters through `functools.wraps` (`inspect.unwrap`) but rewrites
# the wrapper's code to take them (`_patch_function`): a wrapper of `(*args, **kwargs)` has
# too few local names for that ("co_varnames is too small"). transformers decorates most
# forwards so (`can_return_tuple`, `check_model_inputs`, and since 5.24 `deprecate_kwarg` on
# every causal LM's), which sent them all to the export tracer, and a model with a custom
# autograd Function (Bloom's GeLU), which export cannot keep, to module level. So the
# placeholders are made from the wrapped function and the trace calls the wrapper with them
# by name, as the caller did: the wrapper's own Python (renaming deprecated arguments,
# filling defaults, choosing the return type) runs on the proxies like the rest.


class _Tracer(fx.Tracer):
    """`torch.fx.Tracer` whose proxies carry fake values (see the module docstring)."""

    def __init__(self, faker: Faker, inputs: dict[str, Any], real_inputs: dict[str, Any]):
        super().__init__(autowrap_modules=(math,))
        self.real_inputs = real_inputs  # placeholder target -> the example's real value
        self.reals: dict[fx.Node, Any] = {}  # real values computed (NOTE [ Data-dependent ops ])
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
        self.made = MadeOutputs()  # the values of repeated calls, made without a run

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        # The graph returns the forward's proxies as one flat tuple; the containers around
        # them (dicts, dataclasses, ModelOutput, namedtuples, lists) are kept aside as a
        # template, so the executor returns exactly the types the module returns (fx would
        # turn a dict subclass into an immutable_dict and a list into an immutable_list).
        fn, args = self._root_args(root_fn, is_module, concrete_args)

        def flat_output(*a):
            proxies: list[fx.Proxy] = []

            def slot(proxy: fx.Proxy) -> OutputSlot:
                proxies.append(proxy)
                return OutputSlot(len(proxies) - 1)

            self.output_template = map_output(fn(*a), fx.Proxy, slot)
            return tuple(proxies)

        return flat_output, args

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return ValueProxy(node, self)

    def _root_args(self, root_fn, is_module, concrete_args):
        """fx's placeholders for `root_fn`, and the function the trace calls with them; for
        a decorated forward, one that calls the decorator's wrapper with them by name
        (NOTE [ Decorated forwards ])."""
        inner = inspect.unwrap(root_fn)
        if inner is root_fn or not root_fn.__code__.co_flags & HAS_VARSTUFF:
            return super().create_args_for_root(root_fn, is_module, concrete_args)
        patched, args = super().create_args_for_root(inner, is_module, concrete_args)
        if patched.__name__ == "flatten_fn":  # pytree-flattened inputs: fx's own way
            return super().create_args_for_root(root_fn, is_module, concrete_args)
        code = inner.__code__
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        by_position = max(code.co_posonlyargcount, 1 if is_module else 0)

        def through_the_wrapper(*values):
            head, rest = list(values[: len(names)]), list(values[len(names) :])
            star = rest.pop(0) if code.co_flags & inspect.CO_VARARGS else ()
            extra = rest.pop(0) if code.co_flags & inspect.CO_VARKEYWORDS else {}
            if star:  # a *args: everything before it goes by position
                by_name = dict(zip(names[code.co_argcount :], head[code.co_argcount :]))
                return root_fn(*head[: code.co_argcount], *star, **by_name, **extra)
            by_name = dict(zip(names[by_position:], head[by_position:]))
            return root_fn(*head[:by_position], **by_name, **extra)

        return through_the_wrapper, args

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # torch.nn's transformer stacks are whole models, not ops: as leaves, a ViT built from
        # nn.TransformerEncoder would be one node, with nothing to cut.
        if isinstance(m, _TRACED_TORCH_NN):
            return False
        # NOTE [ A module with forward hooks is one node ]
        if module_qualified_name and user_hooks(m):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    # fx patches nn.Module.__call__ / __getattr__ while tracing; computing a value runs real
    # module code on fake tensors, which must not be traced.
    def call_module(self, m, forward, args, kwargs):
        if self.computing or self._made_in_forward(m):
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def _made_in_forward(self, m: nn.Module) -> bool:
        """Whether `m` is a module without parameters that the forward made as it ran
        (`loss_fct = CrossEntropyLoss()`; not one of the root's submodules, so fx has no
        path for it): its forward is traced through, its ops recorded as the caller's."""
        try:
            self.path_of_module(m)
        except NameError:
            return next(m.parameters(), None) is None
        return False

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
            self.values[node] = self.inputs.get(self._input_key(target), MISSING)
        else:
            self.values[node] = self._compute(node)
        return proxy

    def may_have_attribute(self, node: fx.Node, name: str) -> bool:
        """Whether the real value of `node`, a tensor whose fake value has no attribute
        `name`, may have it (NOTE [ Attributes a tensor does not have ])."""
        if node.op == "placeholder":
            real = self.real_inputs.get(self._input_key(node.target), MISSING)
        elif node.op == "get_attr":
            real = self._real_attribute(node.target)
        else:
            return False
        return not isinstance(real, torch.Tensor) or hasattr(real, name)

    def _real_attribute(self, target: str) -> Any:
        """The module's own attribute at `target`. Outside `computing`, fx's patched module
        attribute lookup hands out a parameter's proxy: a real run of the nodes after it
        (NOTE [ Data-dependent ops ]) was traced into the graph (DeBERTa-v2's relative
        embeddings: its whole forward recorded a second time, under no_grad, before its
        labelled loss, and predicted 7-11% below the allocator)."""
        computing, self.computing = self.computing, True
        try:
            return fetch_attr(self.root, target)
        finally:
            self.computing = computing

    def _input_key(self, target: str) -> str:
        return target if target in self.inputs else target.rsplit("_", 1)[0]

    def real(self, node: fx.Node, record: bool = False) -> Any:
        """The node's value in the example's real run, with no autograd (its inputs' too,
        kept: NOTE [ Data-dependent ops ]); with `record`, what each aten op returned is
        recorded on the node (`REAL_RESULTS`). Every node before it runs first, in order:
        an in-place op (`x.mul_(2)`) is a node the later ones do not name."""
        if node in self.reals and not record:
            return self.reals[node]
        for earlier in node.graph.nodes:
            if earlier is node:
                break
            if earlier not in self.reals and earlier.op != "output":
                self._real_one(earlier)
        return self._real_one(node, record)

    def _real_one(self, node: fx.Node, record: bool = False) -> Any:
        if node.op == "placeholder":  # a copy: in-place ops must not change the caller's
            value = tree_map(_cloned, self.real_inputs[self._input_key(node.target)])
        elif node.op == "get_attr":
            value = self._real_attribute(node.target)
        else:
            args, kwargs = fx.node.map_aggregate(
                (node.args, node.kwargs), lambda a: self.reals[a] if isinstance(a, fx.Node) else a
            )
            self.computing = True
            try:
                value, results = record_real_results(
                    lambda *a, **k: run_fx_node(node, self.root, None, a, k), args, kwargs
                )
            finally:
                self.computing = False
            if record:
                node.meta[REAL_RESULTS] = results
        self.reals[node] = value
        return value

    def _value(self, node: fx.Node) -> Any:
        if node not in self.values and node.op == "get_attr":
            self.computing = True  # a real attribute, not the parameter proxy fx would give
            try:
                self.values[node] = self.faker.tree(fetch_attr(self.root, node.target))
            finally:
                self.computing = False
        return self.values.get(node, MISSING)

    def _compute(self, node: fx.Node) -> Any:
        if node.op == "get_attr":
            return self._value(node)
        missing = []
        args, kwargs = fx.node.map_aggregate(
            (node.args, node.kwargs),
            lambda a: self._lookup(a, missing) if isinstance(a, fx.Node) else a,
        )
        if missing:
            return MISSING
        args, kwargs = self.faker.tree((args, kwargs))  # real tensor constants -> fake
        try:
            return self._run_fake(node, args, kwargs)
        except DATA_DEPENDENT:  # one real run tells the fake run what it cannot know
            pass
        except Exception as err:  # noqa: BLE001 - the node stays symbolic, as in plain fx
            self.value_errors.append(f"{node.format_node()}: {type(err).__name__}: {err}")
            return MISSING
        try:
            self.real(node, record=True)
            return self._run_fake(node, args, kwargs)
        except Exception as err:  # noqa: BLE001 - the node stays symbolic, as in plain fx
            self.value_errors.append(f"{node.format_node()}: {type(err).__name__}: {err}")
            return MISSING

    def _run_fake(self, node: fx.Node, args: tuple, kwargs: dict) -> Any:
        self.computing = True
        try:  # NOTE [ Outputs made, not computed ]
            return self.made.run(node, self.root, self.faker, args, kwargs)
        finally:
            self.computing = False

    def _lookup(self, node: fx.Node, missing: list) -> Any:
        v = self._value(node)
        if v is MISSING:
            missing.append(node)
        return v

    def inlining_checkpoints(self):
        """`checkpoints_inlined`, counted in `inlined_checkpoints`."""

        def counted() -> None:
            self.inlined_checkpoints += 1

        return checkpoints_inlined(counted)

    @contextlib.contextmanager
    def recording_autograd_functions(self) -> Iterator[None]:
        """Within: `SomeFunction.apply(...)` (a custom `torch.autograd.Function`) on traced
        values becomes one graph node that calls `SomeFunction.apply`, so the executor runs the
        Function itself, its own backward included (NOTE [ Custom autograd Functions ])."""
        tracer = self

        def apply(real_apply, cls, *args, **kwargs):
            traced = []
            fx.node.map_aggregate(
                (args, kwargs), lambda a: traced.append(a) if isinstance(a, fx.Proxy) else a
            )
            if tracer.computing or not traced:
                return real_apply(*args, **kwargs)
            return tracer.create_proxy("call_function", _function_apply(cls), args, kwargs)

        with function_apply_replaced(apply):
            yield

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


# NOTE [ Custom autograd Functions ]
# `torch.autograd.Function.apply` runs the Function's `forward` with grad mode off and links its
# output to the Function's `backward`. Traced through like any Python, the forward's ops would
# be recorded with grad mode off: their values would not require grad, and the executor would
# let no gradient through them (BLOOM's `GeLUFunction`: the MLP's first Linear and the norm
# before it got no gradient). Even with grad mode on, autograd would differentiate the
# forward's ops instead of calling the Function's backward (a straight-through estimator's
# identity gradient would become round()'s zero). So an applied Function is one node whose
# target calls `apply`: outside tracing, the real one.

_FUNCTION_APPLIES: dict[type, Callable] = {}


@contextlib.contextmanager
def function_apply_replaced(apply: Callable) -> Iterator[None]:
    """Within: `SomeFunction.apply(*args, **kwargs)`, for every `torch.autograd.Function`,
    calls `apply(real_apply, SomeFunction, *args, **kwargs)`, `real_apply` being the original
    bound to the class (the symbolic trace and export each replace it: NOTE [ Custom autograd
    Functions ])."""
    original = torch.autograd.Function.__dict__["apply"]  # a classmethod

    def replaced(cls, *args, **kwargs):
        return apply(original.__get__(None, cls), cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(replaced)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original


def _function_apply(cls: type) -> Callable:
    """The call_function target for `cls.apply` (one per Function class). Named after the
    class and defined here so that fx's generated code refers to it as a global, never as
    `torch.autograd.function.apply` (the inherited classmethod's own module and name)."""
    if cls not in _FUNCTION_APPLIES:

        def apply(*args, **kwargs):
            return cls.apply(*args, **kwargs)

        apply.__name__ = apply.__qualname__ = f"{cls.__name__}_apply"
        _FUNCTION_APPLIES[cls] = apply
    return _FUNCTION_APPLIES[cls]


@contextlib.contextmanager
def checkpoints_inlined(each: Callable[[], None]) -> Iterator[None]:
    """Within: `torch.utils.checkpoint.checkpoint(fn, *args, **kwargs)` (reentrant or not,
    also through `checkpoint_sequential`) just calls `fn(*args, **kwargs)`, so a tracer
    (torch.fx here, non-strict export in `hbp.graph.torch.export`) records its ops and hbp's
    plan decides what is recomputed; `each()` is called per checkpoint call."""

    class InlinedCheckpointFunction:  # stands in for the reentrant CheckpointFunction
        @staticmethod
        def apply(function, preserve_rng_state, *args):
            each()
            return function(*args)

    def inlined_generator(fn, *args, **kwargs):  # non-reentrant: set-up, yield, tear-down
        each()
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


def trace_module(
    module: nn.Module, arguments: dict[str, Any], signature: inspect.Signature, faker: Faker
) -> tuple[fx.GraphModule, list[str], _Tracer]:
    """Trace `module` specialised to `arguments` (forward parameter -> real value); return
    the graph module, the forward parameter of each placeholder and the finished tracer."""
    concrete, inputs, real_inputs = {}, {}, {}
    for name, value in arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            inputs["*" + name] = faker.tree(value, fresh=True)
            real_inputs["*" + name] = value
        elif kind is inspect.Parameter.VAR_KEYWORD:
            inputs["**" + name] = faker.tree(value, fresh=True)
            real_inputs["**" + name] = value
        elif value is None or type(value) in (bool, int, float, str):
            concrete[name] = value
            inputs[name] = value
        else:
            inputs[name] = faker.tree(value, fresh=True)
        real_inputs.setdefault(name, value)
    for t in (*module.parameters(), *module.buffers()):
        faker.tensor(t)  # convert now: fx's patching during tracing makes it ~10x slower
    tracer = _Tracer(faker, inputs, real_inputs)
    state = ModuleState(module)
    try:
        with (
            tracer.recording_factories(),
            tracer.inlining_checkpoints(),
            tracer.recording_buffer_assignments(),
            tracer.recording_autograd_functions(),
            fake_failures_quiet(),
        ):
            graph = tracer.trace(module, concrete_args=concrete or None)
        gm = fx.GraphModule(tracer.root, graph, class_name=type(module).__name__)
    finally:  # fx stores tensor constants on the traced module; forwards assign attributes
        changed = state.restore()
        tracer.reals.clear()
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
        raise ForwardSideEffect(
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


@contextlib.contextmanager
def fake_failures_quiet() -> Iterator[None]:
    """Within: an op whose fake (meta) kernel fails does not log its traceback. Fake tensors log
    one at ERROR level for each such op (`aten._grouped_mm` on float32 in MoE models, several
    lines per layer, or ~200 lines before the one-line error of a forward given a wrong input
    shape); the tracer catches the error itself, keeps the node symbolic, and the capture says
    why in its CaptureWarning if no tracer succeeds, or raises the error. `capture` runs
    every stage within it."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _cloned(x: Any) -> Any:
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def _drop_concrete_arg_asserts(gm: fx.GraphModule, concrete: dict[str, Any]) -> None:
    """fx adds `assert arg is None` / `assert arg == value` nodes for concrete args; the
    cache key already guarantees them, and they would only clutter the IR."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    concrete_targets = {f"{name}_1" for name in concrete}
    erased = False
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
                erased = True
    if erased:  # else the graph module's code is already its graph's
        gm.recompile()
