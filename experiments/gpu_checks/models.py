"""A model check: one workload's training step under every way of training it, each on a fresh
copy of the same weights and batch (the hbp variants share one: one capture, planned again at
each budget, as `hc.budget = ...` does), measured (step.py) and compared with plain autograd.

    naive        plain autograd: the reference gradients and the budgets' base
    checkpoint   uniform checkpointing over the workload's blocks (hbp.modes.checkpoint)
    library      the library's own checkpointing (transformers' gradient_checkpointing_enable)
    hbp@0.5, hbp@0.3, hbp@min, hbp@50%act
                 hbp.HCModule(model, budget=...): predicted peak and recompute from `hc.plan`;
                 "50%act" is the default budget, held to the bytes hbp resolved it to
    hbp@baseline hbp.HCModule with a budget in bytes of the checkpoint or library row's
                 measured peak: hbp's recompute where the checkpointing users have holds

A variant that does not apply to the model (uniform checkpointing of a transformers model,
whose layers are not a chain; library checkpointing of hbp's own models) is an "n/a" row, a
budget no plan meets an "infeasible" row (hbp.BudgetError), and any other exception an "error"
row: the next variant still runs. The first hbp variant also reports the kernel workspace
measured at capture (`workspace_report`).
"""

from __future__ import annotations

import contextlib
import copy
import re
import time
import traceback
from collections.abc import Callable

import torch

import hbp
from hbp.graph.torch import calibrate
from hbp.modes.checkpoint import CheckpointMode
from hbp.modes.library_checkpoint import enable_library_checkpointing
from hbp.planner.budget import Budget, BudgetKind
from hbp.workloads import build

from .sizes import BUDGETS, ModelSpec
from .step import grad_diff, measure, release

#: The hbp variant whose budget is the measured peak of the checkpointing the model has
#: (uniform or the library's): the two rows compare recompute at one peak.
AT_BASELINE = "hbp@baseline"
VARIANTS = ("naive", "checkpoint", "library", *(f"hbp@{b}" for b in BUDGETS), AT_BASELINE)
BASELINES = ("checkpoint", "library")
#: Ops whose kernels allocate workspace: each must have been measured at capture.
WORKSPACE_OPS = re.compile(r"conv|attention|sdpa", re.IGNORECASE)


class NotApplicable(Exception):
    """The variant does not apply to this model (the row says why)."""


def run_model_check(spec: ModelSpec, device: str, timed_steps: int, record: Callable) -> None:
    """Every variant of `spec`'s model, each row passed to `record(row)` as soon as it is done."""
    workload = build(spec.workload, spec.profile, seed=0, **spec.overrides)
    master = workload.model.library_model if spec.hf else workload.model
    batch = workload.make_batch(0).to(device)

    def loss_of(module: torch.nn.Module) -> torch.Tensor:
        if spec.hf:  # as transformers' users train: the library computes the loss
            return module(**batch.kwargs).loss
        return workload.loss_fn(module(*batch.args, **batch.kwargs), batch)

    reference = None
    baseline_peak = None  # the checkpointing row's measured peak (AT_BASELINE's budget)
    hc = None  # the hbp variants share one HCModule: captured once, planned at each budget
    for variant in VARIANTS:
        row = {"model": spec.describe(), "variant": variant, "dtype": "float32"}
        start = time.perf_counter()
        try:
            budget = _budget_of(variant, baseline_peak)
            if hc is not None and variant.startswith("hbp@"):
                module, model = hc, hc.module  # no optimizer step: the weights are the master's
                hc.budget = budget
            else:
                model = copy.deepcopy(master).to(device)
                module = _wrap(variant, model, workload, batch, budget)
                hc = module if isinstance(module, hbp.HCModule) else None
            params = list(model.parameters())  # in the plain model's order, before any wrap
            workspace = variant == f"hbp@{BUDGETS[0]}"
            with _workspace_recorder() if workspace else contextlib.nullcontext() as calls:
                measured = measure(_step(loss_of, module), params, device, timed_steps=timed_steps)
            row.update(measured.fields())
            if variant in BASELINES:
                baseline_peak = measured.peak_bytes
            if isinstance(module, hbp.HCModule):
                row.update(plan_fields(module, budget, reference))
                if workspace:
                    row["workspace"] = workspace_report(module, calls)
            if reference is None:
                reference = row | {"grads": measured.grads}
            else:
                row["grad_diff"] = grad_diff(measured.grads, reference["grads"])
                if reference.get("flops") is not None and row.get("flops") is not None:
                    row["recompute_flops"] = row["flops"] - reference["flops"]
            row["status"] = "ok"
        except NotApplicable as reason:
            row.update(status="n/a", note=str(reason))
        except hbp.BudgetError as error:  # raised in the first step: its time is the error's
            row.update(status="infeasible", note=str(error)[:300])
            row["first_step_s"] = time.perf_counter() - start
        except Exception as error:  # noqa: BLE001 - recorded; the other variants still run
            row.update(status="error", error=f"{type(error).__name__}: {error}"[:600])
            row["traceback"] = traceback.format_exc()[-3000:]
            hc = None  # the next hbp variant starts from a fresh copy
        finally:
            model = module = measured = None
            release(device)
        if variant == "naive" and row["status"] != "ok":
            record(row)
            raise RuntimeError(f"the plain step failed, nothing to compare with: {row['error']}")
        record(row)


def plan_fields(hc: hbp.HCModule, budget: float | int | str, reference: dict | None) -> dict:
    """What hbp predicted (`hc.plan`) and the budget the measured peak is held to: bytes as
    given, a fraction of the naive step's measured peak (the same process, the same batch), the
    bytes hbp resolved an "N%act" budget to (`hc.budget_bytes`); "min" has none."""
    plan = hc.plan
    fields = {
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "predicted_recompute_flops": plan.predicted_recompute_flops,
        "plan_budget_bytes": plan.budget_bytes,
        "budget_bytes": None,
    }
    if isinstance(budget, int):
        fields["budget_bytes"] = budget
    elif isinstance(budget, str) and Budget.parse(budget).kind is BudgetKind.ACTIVATIONS:
        fields["budget_bytes"] = hc.budget_bytes
    elif isinstance(budget, float) and reference is not None and reference.get("peak_bytes"):
        fields["budget_bytes"] = int(budget * reference["peak_bytes"])
    return fields


def _wrap(variant: str, model: torch.nn.Module, workload, batch, budget) -> torch.nn.Module:
    if variant == "naive":
        return model
    if variant == "checkpoint":
        if workload.library is not None:
            raise NotApplicable(f"{workload.library} layers are not a chain; see 'library'")
        CheckpointMode().apply(_with_model(workload, model), batch)
        return model
    if variant == "library":
        if workload.library is None:
            raise NotApplicable("hbp's own model: no library checkpointing; see 'checkpoint'")
        enable_library_checkpointing(model)
        return model
    return hbp.HCModule(model, budget=budget)


def _budget_of(variant: str, baseline_peak: int | None) -> float | int | str | None:
    """An hbp variant's budget (None for the others): "min", a fraction, or for AT_BASELINE
    the checkpointing row's measured peak in bytes (n/a where no such row ran)."""
    if not variant.startswith("hbp@"):
        return None
    if variant == AT_BASELINE:
        if not baseline_peak:
            raise NotApplicable("no checkpointing row measured a peak to hold hbp to")
        return int(baseline_peak)
    budget = variant.split("@", 1)[1]
    return float(budget) if Budget.parse(budget).kind is BudgetKind.FRACTION else budget


def _with_model(workload, model):
    """The workload with `model` in place of its own (CheckpointMode regroups `model.blocks`)."""
    clone = copy.copy(workload)
    clone.model = model
    return clone


def _step(loss_of: Callable, module: torch.nn.Module) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        torch.manual_seed(0)  # the same dropout masks in every variant (profiles use none)
        loss = loss_of(module)
        loss.backward()
        return loss.detach()

    return step


# NOTE [ Which kernels had their workspace measured ]
# hbp measures each op signature's kernel workspace once at capture
# (hbp/graph/torch/calibrate.py) and raises the node's scratch fields through
# `_raise_fields`, for a new signature and for one measured before alike; an op that cannot
# run alone (or is skipped: views, in-place ops) keeps the fake-tensor estimate, which knows no
# workspace. The check wraps `_raise_fields` while the first hbp variant captures and lists,
# per op, the nodes that got a measurement. Convolution and attention kernels are the ones
# whose workspace matters: one of those unmeasured fails the check. This reads a private
# function on purpose: it is a diagnostic of hbp's internals.


@contextlib.contextmanager
def _workspace_recorder():
    calls: dict[str, dict] = {}
    original = calibrate._raise_fields

    def recording(captured, node, forward, backward, *args, **kwargs):
        entry = calls.setdefault(node.name, {"measured": True, "forward": 0, "backward": 0})
        entry["forward"] = max(entry["forward"], forward)
        entry["backward"] = max(entry["backward"], backward)
        return original(captured, node, forward, backward, *args, **kwargs)

    calibrate._raise_fields = recording
    try:
        yield calls
    finally:
        calibrate._raise_fields = original


def workspace_report(hc: hbp.HCModule, calls: dict[str, dict]) -> dict:
    """Per op label of the captured graph: nodes, nodes measured, the largest forward and
    backward workspace measured (bytes); and the convolution / attention nodes not measured."""
    captured = hc.captured
    by_op: dict[str, dict] = {}
    unmeasured = []
    if captured is None or captured.gm is None:
        return {"granularity": getattr(captured, "granularity", None), "ops": {}, "unmeasured": []}
    for node in captured.graph.nodes:
        if node.is_input or node.alias_of is not None:
            continue
        call = calls.get(node.name, {})
        entry = by_op.setdefault(node.op, {"nodes": 0, "measured": 0, "forward": 0, "backward": 0})
        entry["nodes"] += 1
        if call.get("measured"):
            entry["measured"] += 1
            entry["forward"] = max(entry["forward"], call["forward"])
            entry["backward"] = max(entry["backward"], call["backward"])
        elif WORKSPACE_OPS.search(node.op):
            unmeasured.append(f"{node.op} ({node.name})")
    return {"granularity": captured.granularity, "ops": by_op, "unmeasured": unmeasured}
