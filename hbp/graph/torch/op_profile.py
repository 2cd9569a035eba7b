"""One op call profiled on fake tensors (`profile_call` -> `OpProfile`): its output's new bytes
and aliasing, what its backward saves, its FLOPs, its forward and backward peaks, whether it
draws random numbers; identical calls are profiled once (`ProfileCache`). The profile stage
(`hbp.graph.torch.profile`) calls it per fx node, the fallback stage per child module call;
the normalise stage reads an `OpProfile` to decide whether an in-place op can go out of place."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from hbp.graph.torch.fake import (
    RealStorageSizes,
    any_requires_grad,
    made_layout,
    made_output,
    pure_call,
    storage_key,
    tensor_layout,
    tensor_leaves,
)
from hbp.graph.torch.flops import TotalFlopCounterMode

__all__ = ["PROFILE_CACHE", "OpProfile", "ProfileCache", "leaf_rooted", "profile_call"]


@dataclass
class OpProfile:
    """One node run once on fake tensors: its output (fake), the bytes and FLOPs of its
    forward and backward, what its backward saves, and what it mutates (the IR `Node`
    fields of the same names say what each means)."""

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
    backward_flops: float | None = None  # None: its backward could not run alone
    grad_passthrough: list[str] = field(default_factory=list)  # inputs given the output's grad
    value_bytes: int = 0  # numel x element size of the output tensors (their gradients' size)
    # Non-reentrant checkpoint's early stop ends a recompute at the last saved tensor: what
    # of this node would then not run (inputs are saved before an op runs, outputs after).
    flops_after_last_save: float = 0.0
    output_after_last_save: bool = False
    draws_random: bool = False
    # per parameter the node uses (in `params` order): its backward's gradient for it cannot
    # take a second one in place (NOTE [ Gradients of a parameter used twice ])
    param_grad_not_in_place: tuple[bool, ...] = ()
    # an op of the call wrote in place into a tensor an earlier op of the call made (NOTE
    # [ Buffers a recomputed forward writes ] in hbp.runtime.recompute: not pinned)
    writes_own_intermediates: bool = False


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
        self.writes_own = False  # an op wrote into a storage an earlier op here made
        self.created: dict[int, int] = {}  # storage key -> index of the op that made it
        self._tensors: dict[int, list[int]] = {}  # storage key -> [bytes, live tensors]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.draws_random = self.draws_random or _draws_random(func, args, kwargs)
        self.writes_own = self.writes_own or self._writes_own(func, args, kwargs)
        input_keys = {storage_key(t) for t in tensor_leaves((args, kwargs))}
        for t in tensor_leaves(out):
            key = storage_key(t)
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

    def _writes_own(self, func, args, kwargs) -> bool:
        """Whether `func` writes in place into a storage an earlier op of this call made."""
        schema = getattr(func, "_schema", None)
        if schema is None or not schema.is_mutable:  # most ops: nothing to look for
            return False
        for k, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[k] if k < len(args) else kwargs.get(argument.name)
            for t in tensor_leaves(value):
                if storage_key(t) in self.created:
                    return True
        return False

    def will_free(self, tensors: list[torch.Tensor]) -> None:
        """Count the storages of these tensors, made before this mode, as freed (negative live
        bytes) when the last of them dies: a composite op's backward (an RNN's, a leaf
        module's) frees what its forward saved step by step, and its net growth is what
        comes on top of the saved bytes the IR already charges."""
        for t in tensors:
            key = storage_key(t)
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


def leaf_rooted(value: Any) -> bool:
    """Whether a tensor of `value` that requires grad is a leaf or a view of one."""
    return any(
        t.requires_grad and (t.grad_fn is None or (t._base is not None and t._base.is_leaf))
        for t in tensor_leaves(value)
    )


def _leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.requires_grad:
        return x.detach().requires_grad_(True)
    return x


def profile_call(
    run: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    inputs: list[tuple[str, Any]],
    persistent_keys: set[int],
    owners: dict[int, str],
    name: str = "",
    params: tuple[torch.Tensor, ...] = (),
    gradient_view_of: str | None = None,
    cache: ProfileCache | None = None,
    op: tuple | None = None,
) -> OpProfile:
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
        profile = cache.replay(
            key, run, args, kwargs, inputs, persistent_keys, owners, name, params
        )
        if profile is not None:
            return profile
    touched = tensor_leaves((args, kwargs, params)) if key is not None else []
    versions = [t._version for t in touched]
    profile = _profile_call_once(
        run, args, kwargs, inputs, persistent_keys, owners, name, params, gradient_view_of
    )
    if key is not None:
        pure = pure_call(*op[:2]) and all(t._version == v for t, v in zip(touched, versions))
        fresh = _fresh_output_of(profile, args, kwargs, params, pure)
        cache.store(key, profile, inputs, fresh, direct=pure, name=name)
    return profile


def _profile_call_once(
    run, args, kwargs, inputs, persistent_keys, owners, name, params, gradient_view_of
) -> OpProfile:
    """`profile_call` without the cache."""
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
        with hooks, TotalFlopCounterMode() as fc, RealStorageSizes() as real:
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
        key = storage_key(t)
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
    saved_extra = [t for t in saved if storage_key(t) in extra]
    saved.clear()
    profile = OpProfile(
        output=output,
        output_bytes=output_bytes,
        alias_of=alias_of,
        requires_grad=any_requires_grad(output),
        saved_inputs=tuple(saved_inputs),
        saves_output=saves_output,
        saved_extra_bytes=sum(extra.values()),
        flops=float(fc.get_total_flops()),
        mutated_inputs=mutated,
        forward_peak_bytes=memory.peak,
        flops_after_last_save=flops_after_last_save,
        output_after_last_save=after_last_save,
        value_bytes=sum(t.numel() * t.element_size() for t in tensor_leaves(output)),
        draws_random=memory.draws_random,
        writes_own_intermediates=memory.writes_own,
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
        for t in tensor_leaves(value):
            key = storage_key(t)
            if key is not None:
                input_keys.setdefault(key, input_name)
            versions.append((input_name, t, t._version))
    return input_keys, versions


def _classify_output(output, input_keys: dict[int, str], persistent_keys, owners, sizes):
    """(new bytes, the input it aliases, its storage keys, the keys of its new storages) of an
    op's output (`sizes`: real sizes where fake kernels allocate others)."""
    output_bytes, alias_of, output_keys, new_keys = 0, None, set(), []
    for t in tensor_leaves(output):
        key = storage_key(t)
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
# With those equal (`ProfileCache.key`), the node is only run forward on fake values (its
# output is needed downstream) and the rest is taken from the first such node, inputs mapped
# by position. Nodes that mutate an input, run outside autograd's normal path, or run in
# their own modes (autocast, ...) are always profiled; so are call_module nodes (a module's
# Python state is not in its signature), but for stateless library modules (NOTE
# [ Stateless library modules are profiled once ]). A replay whose output does not classify as the
# first node's did (new bytes, aliasing) is profiled in full instead.
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout)
PROFILE_CACHE = True  # off: every node profiled in full (tests compare the two)


#: fx node meta: the name of the earlier node whose profile a replay took (`ProfileCache`)
PROFILED_LIKE = "hbp_profiled_like"


class _Cached(NamedTuple):
    """A profiled call, its input references as positions among the call's inputs."""

    profile: OpProfile
    alias_of: int  # -1: none
    saved_inputs: list[int]
    grad_passthrough: list[int]
    # (shape, strides, dtype, device, requires_grad) of an output a replay makes without
    # running the call (NOTE [ Replayed outputs made, not computed ]); None: run it
    fresh: tuple | None = None
    # a pure call that changed none of its tensors: a replay runs it on the values themselves,
    # not on leaf copies (NOTE [ Replayed outputs made, not computed ])
    direct: bool = False
    # the node profiled in full, whose value a replay's can stand in for (NOTE [ Calibration
    # runs one block ] in hbp.graph.torch.calibrate)
    first: str = ""


class ProfileCache:
    """Profiles of fx-node calls by signature (NOTE [ Identical nodes are profiled once ])."""

    def __init__(self):
        self.entries: dict[tuple, _Cached] = {}
        self.hits = 0
        #: node name -> the node profiled in full that its replay took its profile from
        self.replayed_from: dict[str, str] = {}

    def key(self, op, args, kwargs, inputs, persistent_keys, owners, params, gradient_view_of):
        """The call's signature, or None where it cannot be told (symbolic sizes, arguments
        of other types)."""
        first_input: dict[int, int] = {}
        for i, (_, value) in enumerate(inputs):
            for t in tensor_leaves(value):
                k = storage_key(t)
                if k is not None:
                    first_input.setdefault(k, i)
        storages: dict[int, int] = {}
        leaves, spec = tree_flatten((args, kwargs))
        described = []
        try:
            for x in (*leaves, *params):
                if isinstance(x, torch.Tensor):
                    k = storage_key(x)
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
                            *tensor_layout(x),
                            kind,
                            storages.setdefault(k, len(storages)),
                            int(x.untyped_storage().nbytes()),
                        )
                    )
                elif isinstance(x, _PLAIN) or x is Ellipsis:
                    described.append((type(x), x))
                elif isinstance(x, slice) and all(
                    isinstance(v, (int, type(None))) for v in (x.start, x.stop, x.step)
                ):  # `x[:, None]`, `x[..., :d]` (slices are not hashable before 3.12)
                    described.append((slice, x.start, x.stop, x.step))
                else:
                    return None
        except (TypeError, RuntimeError):  # symbolic sizes, ...
            return None
        names = [n for n, _ in inputs]
        view = names.index(gradient_view_of) if gradient_view_of in names else -1
        return (op, str(spec), len(params), view, tuple(described))

    def store(
        self,
        key: tuple,
        profile: OpProfile,
        inputs,
        fresh: tuple | None = None,
        direct=False,
        name: str = "",
    ) -> None:
        if profile.mutated_inputs:
            return
        names = [n for n, _ in inputs]
        self.entries[key] = _Cached(
            profile,
            names.index(profile.alias_of) if profile.alias_of is not None else -1,
            [names.index(n) for n in profile.saved_inputs],
            [names.index(n) for n in profile.grad_passthrough],
            fresh,
            direct,
            name,
        )

    def replay(self, key, run, args, kwargs, inputs, persistent_keys, owners, name, params=()):
        """The profile of a call with the signature of an earlier one: run forward only, or
        not at all where its output is a new tensor of known layout (NOTE [ Replayed outputs
        made, not computed ])."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        first = entry.profile
        names = [n for n, _ in inputs]
        input_keys, versions = _input_storages(inputs)
        if entry.fresh is not None:
            output = made_output(entry.fresh, (args, kwargs, params))
            output_bytes, alias_of, _, new_keys = _classify_output(
                output, input_keys, persistent_keys, owners, {}
            )
            owners.update(dict.fromkeys(new_keys, name))
            self.hits += 1
            self.replayed_from[name] = entry.first
            return replace(
                first,
                output=output,
                alias_of=None,
                saved_inputs=tuple(names[i] for i in entry.saved_inputs),
                grad_passthrough=[names[i] for i in entry.grad_passthrough],
                value_bytes=output.numel() * output.element_size(),
            )
        call_args, call_kwargs = (args, kwargs) if entry.direct else tree_map(_leaf, (args, kwargs))
        try:
            with RealStorageSizes() as real:
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
            and any_requires_grad(output) == first.requires_grad
        ):
            return None
        owners.update(dict.fromkeys(new_keys, name))
        self.hits += 1
        self.replayed_from[name] = entry.first
        return replace(
            first,
            output=output,
            alias_of=alias_of,
            saved_inputs=tuple(names[i] for i in entry.saved_inputs),
            grad_passthrough=[names[i] for i in entry.grad_passthrough],
            value_bytes=sum(t.numel() * t.element_size() for t in tensor_leaves(output)),
        )


# NOTE [ Replayed outputs made, not computed ]
# A replay (NOTE [ Identical nodes are profiled once ]) runs the call forward only for its
# output, which later nodes run on. Where the first such call returned one new tensor from a
# pure call that changed none of its tensors, a replay makes that output without running the
# call (NOTE [ Outputs made, not computed ] in hbp/graph/torch/fake.py). Other pure calls that
# changed none of their tensors are run on the values themselves rather than on leaf copies
# of them (the copies' only use is a backward, which a replay does not run): the output is
# then the one the profile stage keeps for a view (not a view of a leaf, `leaf_rooted`),
# without running the view again.


def _fresh_output_of(profile: OpProfile, args, kwargs, params, pure: bool) -> tuple | None:
    """`_Cached.fresh` of a call profiled in full (NOTE [ Replayed outputs made, not
    computed ])."""
    if not pure or profile.alias_of is not None or not isinstance(profile.output, torch.Tensor):
        return None
    layout = made_layout(profile.output, (args, kwargs, params))
    if layout is None or profile.output_bytes != profile.output.untyped_storage().nbytes():
        return None
    return layout if profile.output.requires_grad == profile.requires_grad else None


def _profile_backward(
    profile, output, leaves, inputs, params, persistent_keys, saved_extra: list
) -> None:
    """Backpropagate through one node alone (its inputs are leaves): FLOPs and peak bytes
    (net of the node's own saved tensors, `saved_extra`, that its backward frees as it runs;
    the list is emptied so that autograd holds the last references)."""
    outs = [t for t in tensor_leaves(output) if t.requires_grad]
    names = {}
    for input_name, value in inputs:
        for t in tensor_leaves(value):
            names.setdefault(storage_key(t), input_name)
    wrt = [t for t in tensor_leaves(leaves) if t.requires_grad]
    wrt += [p for p in params if p.requires_grad]
    if not outs or not wrt:
        return
    grad_outputs = [torch.ones_like(t) for t in outs]
    known = persistent_keys | {storage_key(t) for t in (*outs, *grad_outputs, *wrt)}
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
    out_grad_keys = {storage_key(g) for g in grad_outputs}
    # a parameter's gradient: its own, or that of the leaf made of it (fx passes the
    # parameters of a call_function node as arguments)
    by_storage: dict[tuple, torch.Tensor] = {}
    for t, g in zip(wrt, grads):
        if g is not None:
            by_storage.setdefault((storage_key(t), tuple(t.shape)), g)
    param_grads = [by_storage.get((storage_key(p), tuple(p.shape))) for p in params]
    profile.param_grad_not_in_place = tuple(
        g is not None and not accumulates_in_place(g) for g in param_grads
    )
    for t, g in zip(wrt, grads):
        input_name = names.get(storage_key(t))
        if g is not None and input_name is not None:
            if storage_key(g) in out_grad_keys:  # add, views, ...: the gradient passes through
                profile.grad_passthrough.append(input_name)


def accumulates_in_place(grad: torch.Tensor) -> bool:
    """Whether autograd's input buffer adds a later gradient into `grad` in place (its
    `can_accumulate_inplace`): a dense, non-overlapping tensor that is not a view (a view's
    base shares its storage: linear's weight gradient is the transpose of a matmul's result,
    `sum`'s an expanded scalar; NOTE [ Gradients of a parameter used twice ])."""
    return grad._base is None and is_non_overlapping_and_dense_or_false(grad)
