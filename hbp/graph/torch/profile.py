"""Profile stage: every node of an op-level fx graph run once on fake tensors, into hbp's IR.

For each node, on fake inputs whose `requires_grad` follows the real run:
- `output_bytes`: bytes of new storage (0 when the output shares an input's storage: views,
  in-place results; `alias_of` names that input);
- `flops`: `hbp.graph.torch.flops.TotalFlopCounterMode` (`FlopCounterMode` plus the formulas
  for CPU flash attention and oneDNN's LSTM that the measured step counts too);
- what backward keeps: the node runs under `torch.autograd.graph.saved_tensors_hooks` and
  each saved tensor is classified by storage identity: an input's storage -> `saved_inputs`,
  the node's own output -> `saves_output`, a parameter/buffer/constant -> nothing (they are
  not activations), anything else -> `saved_extra_bytes` (dropout masks, norm statistics,
  attention logsumexp, ...);
- `param_grad_bytes`: each trainable parameter charged to its last forward user;
- the node's backward is run too (on detached copies of its inputs), for `backward_flops` and
  for the memory facts `_record_transients` records: scratch bytes a node holds only while
  its forward or backward runs, gradients whose size differs from the output's storage
  (views), inputs whose gradient is the output's gradient itself (add, views). With these
  the simulator matches the tracker-measured peak.
"""

from __future__ import annotations

import inspect
import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from hbp.graph.ir import Graph, Node
from hbp.graph.torch.captured import OP, CapturedGraph
from hbp.graph.torch.fake import (
    _Faker,
    _fetch_attr,
    _RealStorageSizes,
    _requires_grad,
    _run_fx_node,
    _storage_key,
    _tensors,
)
from hbp.graph.torch.flops import TotalFlopCounterMode
from hbp.graph.torch.modes import MODES
from hbp.graph.torch.normalise import _mutates_persistent, _out_of_place, _updated_running_stats
from hbp.graph.torch.running_stats import stat_tracking_norms


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
        self.draws_random = False  # an op drew from the random number generator
        self.created: dict[int, int] = {}  # storage key -> index of the op that made it
        self._tensors: dict[int, list[int]] = {}  # storage key -> [bytes, live tensors]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.draws_random = self.draws_random or _draws_random(func, args, kwargs)
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
                # the key is the storage's address, which a later storage may reuse: that one
                # is created when it is, not when this one was
                self.created.pop(key, None)


def _draws_random(func, args: tuple, kwargs: dict) -> bool:
    """Whether the aten op `func` draws from the random number generator: tagged
    `nondeterministic_seeded` (dropout, bernoulli, rand, ...), except an attention kernel
    (tagged because it can apply dropout) called with `dropout_p` 0."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    schema = getattr(func, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dropout_p" in names:
        position = names.index("dropout_p")
        p = kwargs.get("dropout_p", args[position] if position < len(args) else 0.0)
        return p != 0
    return True


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
    draws_random: bool = False


def _leaf_rooted(value: Any) -> bool:
    """Whether a tensor of `value` that requires grad is a leaf or a view of one."""
    return any(
        t.requires_grad and (t.grad_fn is None or (t._base is not None and t._base.is_leaf))
        for t in _tensors(value)
    )


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
    cache: _ProfileCache | None = None,
    op: tuple | None = None,
) -> _Profile:
    """Run `run(*args, **kwargs)` (its inputs are `inputs`: (IR name, value)) on detached
    copies of its inputs, and classify its memory; then run its backward (FLOPs, peak bytes).

    persistent_keys: storages of parameters, buffers and constants (never charged).
    owners: storage key -> IR name of the node that created it; new storages are added
        under `name`.
    params: (fake) parameters `run` uses, for the backward.
    gradient_view_of: the input of a view op whose backward views the output's gradient
        (`_gradient_view_input`): when the output aliases it, the backward is not run.
    cache, op: profiles of the calls made so far, and what this call runs (hashable; None:
        not cached) (NOTE [ Identical nodes are profiled once ]).
    """
    key = None
    if cache is not None and op is not None:
        key = cache.key(op, args, kwargs, inputs, persistent_keys, owners, params, gradient_view_of)
    if key is not None:
        profile = cache.replay(key, run, args, kwargs, inputs, persistent_keys, owners, name)
        if profile is not None:
            return profile
    profile = _profile_call_once(
        run, args, kwargs, inputs, persistent_keys, owners, name, params, gradient_view_of
    )
    if key is not None:
        cache.store(key, profile, inputs)
    return profile


def _profile_call_once(
    run, args, kwargs, inputs, persistent_keys, owners, name, params, gradient_view_of
) -> _Profile:
    """`_profile_call` without the cache."""
    input_keys, versions = _input_storages(inputs)
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

    output_bytes, alias_of, output_keys, new_keys = _classify_output(
        output, input_keys, persistent_keys, owners, real.sizes
    )
    owners.update(dict.fromkeys(new_keys, name))
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
        draws_random=memory.draws_random,
    )
    if detached and not mutated and profile.requires_grad:
        if gradient_view_of is not None and alias_of == gradient_view_of and not profile.flops:
            profile.grad_passthrough.append(gradient_view_of)  # what the backward would find
        else:
            _profile_backward(profile, output, leaves, inputs, params, persistent_keys, saved_extra)
    saved_extra.clear()
    return profile


def _input_storages(inputs) -> tuple[dict[int, str], list[tuple[str, torch.Tensor, int]]]:
    """Of a call's inputs ((IR name, value)): storage key -> the first input's name on it, and
    (name, tensor, version) of every input tensor (to tell which ones the call mutates)."""
    input_keys: dict[int, str] = {}
    versions = []
    for input_name, value in inputs:
        for t in _tensors(value):
            key = _storage_key(t)
            if key is not None:
                input_keys.setdefault(key, input_name)
            versions.append((input_name, t, t._version))
    return input_keys, versions


def _classify_output(output, input_keys: dict[int, str], persistent_keys, owners, sizes):
    """(new bytes, the input it aliases, its storage keys, the keys of its new storages) of an
    op's output (`sizes`: real sizes where fake kernels allocate others)."""
    output_bytes, alias_of, output_keys, new_keys = 0, None, set(), []
    for t in _tensors(output):
        key = _storage_key(t)
        if key is None:
            continue
        output_keys.add(key)
        if key in input_keys:
            alias_of = alias_of or input_keys[key]
        elif key not in persistent_keys and key not in owners and key not in new_keys:
            output_bytes += sizes.get(key, t.untyped_storage().nbytes())
            new_keys.append(key)
    return output_bytes, alias_of, output_keys, new_keys


# NOTE [ Identical nodes are profiled once ]
# A model's layers repeat, so most fx nodes are the same op on the same kind of values as a
# node of an earlier layer. What profiling learns about a node (FLOPs, what its backward
# saves, its scratch, its backward's FLOPs and gradients) depends only on the op, its
# non-tensor arguments and, per tensor argument, its metadata (shape, strides, offset, dtype,
# device, requires_grad), its storage (size; shared with which other argument; a parameter's,
# a node input's — which one —, an earlier node's or a new one) and the parameters it uses.
# With those equal (`_ProfileCache.key`), the node is only run forward on fake values (its
# output is needed downstream) and the rest is taken from the first such node, inputs mapped
# by position. Nodes that mutate an input, run outside autograd's normal path, or run in
# their own modes (autocast, ...) are always profiled; so are call_module nodes (a module's
# Python state is not in its signature). A replay whose output does not classify as the
# first node's did (new bytes, aliasing) is profiled in full instead.
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout)
PROFILE_CACHE = True  # off: every node profiled in full (tests compare the two)


class _Cached(NamedTuple):
    """A profiled call, its input references as positions among the call's inputs."""

    profile: _Profile
    alias_of: int  # -1: none
    saved_inputs: list[int]
    grad_passthrough: list[int]


class _ProfileCache:
    """Profiles of fx-node calls by signature (NOTE [ Identical nodes are profiled once ])."""

    def __init__(self):
        self.entries: dict[tuple, _Cached] = {}
        self.hits = 0

    def key(self, op, args, kwargs, inputs, persistent_keys, owners, params, gradient_view_of):
        """The call's signature, or None where it cannot be told (symbolic sizes, arguments
        of other types)."""
        first_input: dict[int, int] = {}
        for i, (_, value) in enumerate(inputs):
            for t in _tensors(value):
                k = _storage_key(t)
                if k is not None:
                    first_input.setdefault(k, i)
        storages: dict[int, int] = {}
        leaves, spec = tree_flatten((args, kwargs))
        described = []
        try:
            for x in (*leaves, *params):
                if isinstance(x, torch.Tensor):
                    k = _storage_key(x)
                    if k is None:
                        return None
                    if k in persistent_keys:
                        kind = -1
                    elif k in first_input:
                        kind = first_input[k]
                    else:
                        kind = -2 if k in owners else -3
                    described.append(
                        (
                            tuple(int(d) for d in x.shape),
                            tuple(int(d) for d in x.stride()),
                            int(x.storage_offset()),
                            x.dtype,
                            x.device,
                            x.requires_grad,
                            kind,
                            storages.setdefault(k, len(storages)),
                            int(x.untyped_storage().nbytes()),
                        )
                    )
                elif isinstance(x, _PLAIN) or x is Ellipsis:
                    described.append((type(x), x))
                else:
                    return None
        except (TypeError, RuntimeError):  # symbolic sizes, ...
            return None
        names = [n for n, _ in inputs]
        view = names.index(gradient_view_of) if gradient_view_of in names else -1
        return (op, str(spec), len(params), view, tuple(described))

    def store(self, key: tuple, profile: _Profile, inputs) -> None:
        if profile.mutated_inputs:
            return
        names = [n for n, _ in inputs]
        self.entries[key] = _Cached(
            profile,
            names.index(profile.alias_of) if profile.alias_of is not None else -1,
            [names.index(n) for n in profile.saved_inputs],
            [names.index(n) for n in profile.grad_passthrough],
        )

    def replay(self, key, run, args, kwargs, inputs, persistent_keys, owners, name):
        """The profile of a call with the signature of an earlier one: run forward only."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        first = entry.profile
        names = [n for n, _ in inputs]
        input_keys, versions = _input_storages(inputs)
        call_args, call_kwargs = tree_map(_leaf, (args, kwargs))
        try:
            with _RealStorageSizes() as real:
                output = run(*call_args, **call_kwargs)
        except RuntimeError:  # profiled off leaves the first time: profile it in full
            return None
        output_bytes, alias_of, _, new_keys = _classify_output(
            output, input_keys, persistent_keys, owners, real.sizes
        )
        alias = names.index(alias_of) if alias_of is not None else -1
        unchanged = all(t._version == v for _, t, v in versions)
        if not (
            unchanged
            and output_bytes == first.output_bytes
            and alias == entry.alias_of
            and _requires_grad(output) == first.requires_grad
        ):
            return None
        owners.update(dict.fromkeys(new_keys, name))
        self.hits += 1
        return replace(
            first,
            output=output,
            alias_of=alias_of,
            saved_inputs=tuple(names[i] for i in entry.saved_inputs),
            grad_passthrough=[names[i] for i in entry.grad_passthrough],
            value_bytes=sum(t.numel() * t.element_size() for t in _tensors(output)),
        )


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
    cache = _ProfileCache() if PROFILE_CACHE else None
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
                node, gm, faker, values, owners, persistent_keys, cache
            )
            if not _mutates_persistent(node, profiles[node.name], values, persistent_keys) and (
                _out_of_place(node, ir_node, profiles[node.name], gm, by_name, fx_nodes, order)
            ):
                changed = True
                for key in [k for k, owner in owners.items() if owner == node.name]:
                    del owners[key]
                ir_node, params, profiles[node.name], attrs = _profile_fx_node(
                    node, gm, faker, values, owners, persistent_keys, cache
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
      no tensor holds is added by `hbp.graph.torch.calibrate`.
    - `flops_after_last_save` / `output_after_last_save`: what of a node does not run when a
      recompute pass early-stops at it (torch saves an op's inputs before the op runs and its
      outputs after): the FLOPs after its last saved tensor, and whether its output storage
      is allocated after it (a Linear that saves only its input: the matmul and its output).
    - `draws_random`: an op of the node drew from the random number generator.
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
        node.draws_random = bool(prof.draws_random)
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
    cache: _ProfileCache | None = None,
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
    op = None
    if (
        cache is not None
        and node.op in ("call_function", "call_method")
        and not node.meta.get(MODES)
    ):
        op = (node.op, node.target)
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
            cache,
            op,
        )
    values[node] = prof.output
    if prof.alias_of is not None and not prof.mutated_inputs and _leaf_rooted(prof.output):
        # A view profiled on a leaf copy of its input is a view of a leaf: an in-place op on it
        # later (`torch.flatten` then `nn.Dropout(inplace=True)`, `nn.Identity` then
        # `nn.ReLU(inplace=True)`) would fail where the real forward does not. Keep the view
        # of the real (non-leaf) input instead.
        with faker.mode:
            values[node] = _run_fx_node(node, gm, faker, args, kwargs)
    mutated_attrs = tuple(
        dict.fromkeys(
            [
                *(
                    k
                    for k, b, v in buffer_versions
                    if faker.tensor(b)._version != v and id(b) not in guarded
                ),
                *_updated_running_stats(node),
            ]
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
