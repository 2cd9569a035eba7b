"""Fallback stage: module-level cut points, where every op-level tracer fails.

The child module calls of one forward (recorded with forward hooks during a fake run; a real
`no_grad` run if the fake run fails too), down to the repeated blocks (the items of an
`nn.ModuleList` / `nn.Sequential` of two or more modules, at any depth: the cut points the
libraries' own checkpointing uses), each profiled in isolation, as a chain of IR nodes. The
forward is called with the caller's own arguments. `hbp.runtime.executors.module_calls.ModuleCallExecutor`
checkpoints whole calls (and runs of an nn.Sequential's children) by patching `forward`s."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from hbp.graph.ir import Graph, Node
from hbp.graph.torch.captured import MODULE, CapturedGraph
from hbp.graph.torch.fake import Faker, call_module, rng_preserved, storage_key, tensor_leaves
from hbp.graph.torch.op_profile import OpProfile, profile_call
from hbp.graph.torch.profile import (
    charge_out_of_place_sums,
    charge_param_grads,
    record_scratch,
)
from hbp.graph.torch.running_stats import frozen_running_stats, stat_tracking_norms
from hbp.graph.torch.state import ModuleState


@dataclass
class _Call:
    path: str
    occurrence: int
    module: nn.Module
    args: tuple
    kwargs: dict
    output: Any


def _record_calls(
    module: nn.Module, args: tuple, kwargs: dict, faker: Faker | None
) -> tuple[list[_Call], list[tuple[str, int, int, int, tuple[int, ...]]]]:
    """The child module calls of one forward `module(*args, **kwargs)` (the caller's own
    arguments: decorators that fill defaults into `**kwargs` must not see them twice), down
    to the repeated blocks (`_expand_sequential`), with their inputs and outputs, and the
    expanded Sequential calls."""
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
    state = ModuleState(module)  # the forward's Python side effects are undone after
    try:
        if faker is None:
            with buffers_restored(module):
                module.forward(*args, **kwargs)
        else:
            fake_args, fake_kwargs = faker.tree((args, kwargs), fresh=True)
            with faker.mode:
                call_module(faker, module, fake_args, fake_kwargs)
    finally:
        for h in handles:
            h.remove()
        state.restore()
    # `calls` is in completion order (children before their parent).
    out: list[_Call] = []
    groups: list[tuple[str, int, int, int, tuple[int, ...]]] = []
    _expand_sequential(calls, 0, out, groups, _holding_blocks(module))
    return out, groups


def _holding_blocks(module: nn.Module) -> set[int]:
    """Ids of the submodules to look inside for cut points: those with repeated blocks below
    them (an nn.ModuleList / nn.Sequential of two or more modules, at any depth) that are not
    themselves such a block. GPT-2 -> its transformer -> the blocks `h.0`, `h.1`, ...: the
    cut points the libraries' own checkpointing uses."""
    containers = [
        m for m in module.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1
    ]
    blocks = {id(item) for c in containers for item in c}
    holding = set()
    for m in module.modules():
        if id(m) in blocks:
            continue
        if any(d is not m and any(d is c for c in containers) for d in m.modules()):
            holding.add(id(m))
    return holding


@contextlib.contextmanager
def buffers_restored(module: nn.Module) -> Iterator[None]:
    """Inside, a real forward may update buffers in place (running means, step counters);
    the values of those it wrote are put back on exit (the others are not touched)."""
    saved = [(b, b._version, b.clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, version, value in saved:
                # batch norm updates its running statistics without bumping their version
                if b._version != version or not torch.equal(b, value):
                    b.copy_(value)


def _expand_sequential(
    calls: list[tuple[int, _Call]],
    level: int,
    out: list[_Call],
    groups: list[tuple[str, int, int, int, tuple[int, ...]]],
    holding: set[int] = frozenset(),
) -> list[int]:
    """Append to `out` the calls at `level`, each nn.Sequential call, and each call of a
    module in `holding` (`_holding_blocks`), replaced by its children's calls (recursively),
    and return where each call at `level` starts in `out`. For each replaced Sequential call
    append to `groups` (path, occurrence, first, end, where each direct child starts) in
    `out` positions: a Sequential's children form a chain with no other code between them,
    so any run of them can be checkpointed as one function (the calls inside another module
    are checkpointed one by one: its own code runs between them)."""
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
                children = _expand_sequential(pending, level + 1, out, groups, holding)
                groups.append((call.path, call.occurrence, first, len(out), tuple(children)))
            elif id(call.module) in holding and pending:
                _expand_sequential(pending, level + 1, out, groups, holding)
            else:
                out.append(call)
            pending = []
    return starts


def capture_modules(
    module: nn.Module,
    bound: inspect.BoundArguments,
    signature: inspect.Signature,
    reason: str,
    args: tuple = (),
    kwargs: dict | None = None,
) -> CapturedGraph:
    norms = stat_tracking_norms(module)
    faker = Faker()
    try:
        calls, groups = _record_calls(module, args, kwargs or {}, faker)
        recorded_fake = True
    except Exception:  # noqa: BLE001 - data-dependent Python: record a real no-grad run
        with torch.no_grad(), frozen_running_stats(norms):
            calls, groups = _record_calls(module, args, kwargs or {}, None)
        recorded_fake = False
    if not calls:
        raise RuntimeError("its forward calls no child modules to cut at")
    real_inputs = tensor_leaves((args, kwargs))
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
    profiles: dict[str, OpProfile] = {}
    mutated_inputs: dict[str, tuple[str, ...]] = {}
    mutated_attrs: dict[str, tuple[str, ...]] = {}  # NOTE [ Buffers a recomputed forward writes ]
    upstream_requires_grad = input_requires_grad
    prev = "input"
    for call in calls:
        written: list[str] = []
        prof = _profile_module_call(
            call, faker, recorded_fake, norms, upstream_requires_grad, written
        )
        upstream_requires_grad = upstream_requires_grad or any(
            p.requires_grad for p in call.module.parameters()
        )
        name = f"{call.path.replace('.', '_')}_{call.occurrence}"
        profiles[name] = prof
        if prof.mutated_inputs:  # checkpointing this call would save an input it overwrites
            mutated_inputs[name] = (prev,)
        if written:
            mutated_attrs[name] = tuple(written)
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
    charge_param_grads(nodes, params_used)
    graph = Graph(
        nodes,
        [prev],
        meta={"framework": "torch", "granularity": MODULE, "fallback_reason": reason},
    )
    record_scratch(graph, profiles)
    charge_out_of_place_sums(nodes, params_used, profiles)
    for node in graph.nodes:
        # A node here is a whole child call: the simulator's early stop inside the last node
        # (NOTE [ Early stop at the last pack ] in hbp/analysis/simulate.py) is modelled
        # per op; for a call, what of it runs before its last save is not known, and with it
        # the prediction of module-level plans moved 5% above what they measured.
        node.output_after_last_save, node.flops_after_last_save = False, 0.0
    return CapturedGraph(
        graph=graph,
        gm=None,
        granularity=MODULE,
        input_names=list(bound.arguments),
        signature=signature,
        mutated_inputs=mutated_inputs,
        mutated_attrs=mutated_attrs,
        module_calls=[(c.path, c.occurrence) for c in calls],
        module_groups=[
            (path, k, first + 1, end + 1, tuple(c + 1 for c in children))
            for path, k, first, end, children in groups
        ],
        fallback_reason=reason,
    )


def _profile_module_call(
    call: _Call,
    faker: Faker,
    recorded_fake: bool,
    norms,
    upstream_requires_grad: bool,
    written: list[str],
) -> OpProfile:
    """Profile one recorded child call in isolation on fake copies of its recorded inputs
    (real ones if the child itself cannot run on fake tensors). The paths of the buffers the
    call writes in place, norm statistics aside, are appended to `written` (on fake copies
    only: a real run's writes are not told apart from the norms')."""
    guarded = {id(b) for m in stat_tracking_norms(call.module) for b in m.buffers()}
    buffers = [
        (f"{call.path}.{k}" if call.path else k, b)
        for k, b in call.module.named_buffers()
        if id(b) not in guarded
    ]

    def leaf_inputs(convert):
        def leaf(x):
            if not isinstance(x, torch.Tensor):
                return x
            y = convert(x.detach())
            if y.is_floating_point() and (x.requires_grad or upstream_requires_grad):
                # Not a leaf: the child may update its input in place (`nn.ReLU(inplace=True)`
                # after an `nn.Identity`), which autograd forbids on a leaf.
                y = y.requires_grad_(True).clone()
            return y

        return tree_map(leaf, (call.args, call.kwargs))

    state = (*call.module.parameters(), *call.module.buffers())
    try:
        args, kwargs = leaf_inputs(faker.fresh)  # real inputs are detached outside the mode
        versions = [(path, faker.tensor(b), faker.tensor(b)._version) for path, b in buffers]
        with faker.mode:
            prof = profile_call(
                lambda *a, **k: call_module(faker, call.module, a, k),
                args,
                kwargs,
                [("in", (args, kwargs))],
                {storage_key(faker.tensor(t)) for t in state},
                {},
                params=tuple(faker.tensor(p) for p in call.module.parameters()),
            )
        written.extend(path for path, fake, version in versions if fake._version != version)
        return prof
    except Exception:  # noqa: BLE001 - a data-dependent child: profile it for real
        if recorded_fake:
            raise
        with frozen_running_stats(norms), rng_preserved(call.module, {}):
            args, kwargs = leaf_inputs(lambda x: x.clone())
            return profile_call(
                call.module.forward,
                args,
                kwargs,
                [("in", (args, kwargs))],
                {storage_key(t) for t in state},
                {},
                params=tuple(call.module.parameters()),
            )
