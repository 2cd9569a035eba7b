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
  for the memory facts `record_scratch` records: scratch bytes a node holds only while
  its forward or backward runs, gradients whose size differs from the output's storage
  (views), inputs whose gradient is the output's gradient itself (add, views). With these
  the simulator matches the tracker-measured peak.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from hbp.graph.ir import Graph, Node
from hbp.graph.torch import op_profile
from hbp.graph.torch.breaks import REAL_RESULTS
from hbp.graph.torch.captured import OP, CapturedGraph
from hbp.graph.torch.fake import (
    Faker,
    any_requires_grad,
    fetch_attr,
    run_fx_node,
    stateless_module,
    storage_key,
    tensor_leaves,
)
from hbp.graph.torch.gradient_layouts import check_pass_through
from hbp.graph.torch.modes import MODES
from hbp.graph.torch.normalise import mutates_persistent, out_of_place, updated_running_stats
from hbp.graph.torch.op_profile import OpProfile, leaf_rooted, profile_call
from hbp.graph.torch.running_stats import stat_tracking_norms


def profile_graph(
    gm: fx.GraphModule,
    module: nn.Module,
    arguments: dict[str, Any],
    input_names: list[str],
    signature: inspect.Signature,
    faker: Faker,
) -> CapturedGraph:
    """Run every node of `gm` on fake values and build the IR. An in-place op that can be
    made out of place (`out_of_place`) is, right after it ran, and is run again so."""
    persistent = [faker.tensor(t) for t in (*module.parameters(), *module.buffers())]
    persistent += [faker.tensor(t) for t in (*gm.parameters(), *gm.buffers())]
    persistent_keys = {k for k in map(storage_key, persistent) if k is not None}

    values: dict[fx.Node, Any] = {}
    owners: dict[int, str] = {}
    nodes: list[Node] = []
    fx_nodes: list[fx.Node] = []
    params_used: list[list[nn.Parameter]] = []
    mutated_inputs: dict[str, tuple[str, ...]] = {}
    mutated_attrs: dict[str, tuple[str, ...]] = {}
    writes_own: set[str] = set()
    profiles: dict[str, OpProfile] = {}
    placeholders = iter(input_names)
    outputs: list[str] = []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_name: dict[str, Node] = {}
    cache = op_profile.ProfileCache() if op_profile.PROFILE_CACHE else None
    changed = False

    for node in gm.graph.nodes:
        if node.op == "output":
            outputs = list(
                dict.fromkeys(n.name for n in node.all_input_nodes if n.op != "get_attr")
            )
        elif node.op == "get_attr":
            values[node] = faker.tree(fetch_attr(gm, node.target))
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
            if not mutates_persistent(node, profiles[node.name], values, persistent_keys) and (
                out_of_place(
                    node, ir_node, profiles[node.name], gm, by_name, fx_nodes, order, values
                )
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
            if profiles[node.name].writes_own_intermediates:
                writes_own.add(node.name)
            nodes.append(ir_node)
            fx_nodes.append(node)
            params_used.append(params)
        if fx_nodes and fx_nodes[-1] is node:
            by_name[node.name] = nodes[-1]

    for node in gm.graph.nodes:  # NOTE [ Calibration runs one block ]
        first = cache.replayed_from.get(node.name) if cache is not None else None
        if first is None:
            node.meta.pop(op_profile.PROFILED_LIKE, None)
        else:
            node.meta[op_profile.PROFILED_LIKE] = first
    if changed:
        gm.graph.lint()
        gm.recompile()
    charge_param_grads(nodes, params_used)
    graph = Graph(
        nodes,
        outputs,
        meta={"framework": "torch", "granularity": OP, "fx_nodes": len(gm.graph.nodes)},
    )
    record_scratch(graph, profiles)
    # NOTE [ Gradients in the layout they arrive in ]
    check_pass_through(nodes, fx_nodes, values, gm, faker)
    charge_out_of_place_sums(nodes, params_used, profiles)
    return CapturedGraph(
        graph=graph,
        gm=gm,
        granularity=OP,
        fx_nodes=fx_nodes,
        input_names=input_names,
        signature=signature,
        mutated_inputs=mutated_inputs,
        mutated_attrs=mutated_attrs,
        writes_own_intermediates=frozenset(writes_own),
    )


# NOTE [ Gradients of a parameter used twice ]
# A parameter read by several nodes (a tied output head and input embedding) has one
# AccumulateGrad node, which runs once all its gradient contributions have arrived: they are
# summed in its input buffer first. The first contribution in backward order (from the last
# user in forward order) is held there, charged to that user as the parameter's gradient
# (`charge_param_grads`; AccumulateGrad then steals the sum into `.grad`). Each later
# contribution is made by its node's backward (its scratch, as profiled) and added: in place
# into the held sum when autograd can (`op_profile.accumulates_in_place`), else out of place,
# a new parameter-sized sum while both addends are still live (torch/csrc/autograd/
# input_buffer.cpp, `accumulate`). A view is never added to in place: linear's weight gradient
# is one, so an embedding tied to an output head gets its sum out of place. That new sum is
# `grad_sum_bytes` of the node whose contribution is added: the engine adds after that node's
# backward has released its saved tensors and output gradient (engine.cpp,
# `evaluate_function`: `call_function`, `release_variables`, then the input buffers), so the
# simulator charges the sum and the contribution then, not during the node's backward (an
# encoder's embedding: its output gradient is a whole activation); the sum is fresh, so
# contributions after it are added in place. Under a dispatch
# mode (a memory tracker), autograd always adds out of place: the allocator is the reference.


def charge_out_of_place_sums(
    nodes: list[Node], params_used: list[list[nn.Parameter]], profiles: dict[str, OpProfile]
) -> None:
    """Charge the sums autograd makes out of place for parameters used by several nodes
    (NOTE [ Gradients of a parameter used twice ])."""
    users: dict[int, list[int]] = {}
    sized: dict[int, nn.Parameter] = {}
    for i, params in enumerate(params_used):
        for p in params:
            if p.requires_grad:
                users.setdefault(id(p), []).append(i)
                sized[id(p)] = p
    for key, at in users.items():
        at = list(dict.fromkeys(at))
        if len(at) < 2:
            continue
        first = at[-1]  # its gradient comes first in backward
        profile = profiles.get(nodes[first].name)
        flags = profile.param_grad_not_in_place if profile is not None else ()
        position = next(k for k, p in enumerate(params_used[first]) if id(p) == key)
        if position < len(flags) and flags[position]:
            p = sized[key]
            nodes[at[-2]].grad_sum_bytes += p.numel() * p.element_size()


def charge_param_grads(nodes: list[Node], params_used: list[list[nn.Parameter]]) -> None:
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


def record_scratch(graph: Graph, profiles: dict[str, OpProfile]) -> None:
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
    for t in tensor_leaves(value):
        key = storage_key(t)
        if key is not None and key not in owners and key not in persistent_keys:
            owners[key] = name
            nbytes += t.untyped_storage().nbytes()
    return Node(
        name=name,
        op="input",
        output_bytes=nbytes,
        requires_grad=any_requires_grad(value),
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
    faker: Faker,
    values: dict[fx.Node, Any],
    owners: dict[int, str],
    persistent_keys: set[int],
    cache: op_profile.ProfileCache | None = None,
) -> tuple[Node, list[nn.Parameter], OpProfile, tuple[str, ...]]:
    """Run one fx node on fake values; return its IR node, the parameters it uses, its
    profile and the attributes (buffers) it mutates in place."""
    ir_inputs = [n for n in node.all_input_nodes if n.op != "get_attr"]
    attr_inputs = [n for n in node.all_input_nodes if n.op == "get_attr"]
    state: list[tuple[str, torch.Tensor]] = [
        (n.target, t) for n in attr_inputs for t in tensor_leaves(fetch_attr(gm, n.target))
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
    # a graph break's sizes are its own data's (NOTE [ Data-dependent ops ])
    if cache is not None and not node.meta.get(MODES) and not node.meta.get(REAL_RESULTS):
        if node.op in ("call_function", "call_method"):
            op = (node.op, node.target)
        elif node.op == "call_module" and stateless_module(sub):
            # NOTE [ Stateless library modules are profiled once ]
            op = (node.op, type(sub), repr(sub), sub.training)
    with faker.mode:
        prof = profile_call(
            lambda *a, **k: run_fx_node(node, gm, faker, a, k),
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
    if prof.alias_of is not None and not prof.mutated_inputs and leaf_rooted(prof.output):
        # A view profiled on a leaf copy of its input is a view of a leaf: an in-place op on it
        # later (`torch.flatten` then `nn.Dropout(inplace=True)`, `nn.Identity` then
        # `nn.ReLU(inplace=True)`) would fail where the real forward does not. Keep the view
        # of the real (non-leaf) input instead.
        with faker.mode:
            values[node] = run_fx_node(node, gm, faker, args, kwargs)
    mutated_attrs = tuple(
        dict.fromkeys(
            [
                *(
                    k
                    for k, b, v in buffer_versions
                    if faker.tensor(b)._version != v and id(b) not in guarded
                ),
                *updated_running_stats(node),
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
        writes_in_place=bool(prof.mutated_inputs),
    )
    return ir_node, params, prof, mutated_attrs
