"""One real model's training step with and without HCModule, measured by the CPU allocator.

`measure_model(name, build)` runs, for `build() -> (model, step)`:

- the plain step's peak by the allocator (`allocator_peak`, the second step: a warm-up first),
- `hbp.estimate(..., keeps_outputs=False)`: its naive peak and predicted peak per budget,
- per budget (0.5 and "min" by default): a fresh `HCModule`, its first step (capture, scratch
  calibration, plan) timed outside any measurement window, then its second step measured by
  the allocator: measured / budget, predicted / measured, recompute (the step's FLOPs over the
  plain step's, minus 1) and the largest gradient difference from plain autograd
  (`grad_error`),
- for models whose step changes buffers (BatchNorm running statistics and counters): the
  largest difference of the buffers after HCModule's first step and after its measured step
  from those after a plain step from the same state (`buffer_error`; printed as
  "; buffers first/measured" beside the gradient error).
"""

from __future__ import annotations

import time
import warnings

import torch

import hbp
from hbp.allocator import allocator_peak
from hbp.runtime.flops import TotalFlopCounterMode
from hbp.units import MIB


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model, runner, step):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    step(runner)


def measured(model, runner, step):
    """(allocator peak, FLOPs, gradients) of one step of `runner` (model or HCModule)."""
    _, peak = allocator_peak(lambda: _step(model, runner, step))
    grads = _grads(model)
    with TotalFlopCounterMode() as counter:
        _step(model, runner, step)
    return peak, counter.get_total_flops(), grads


def grad_error(got, ref):
    """The largest difference of a parameter's gradient from plain autograd's, relative to
    that gradient's largest entry, floored at 1e-4 of the largest entry of any gradient:
    gradients that are zero in exact arithmetic (an attention key's bias: softmax ignores it)
    are rounding noise of 1e-11, whose relative error says nothing."""
    if set(ref) ^ set(got):
        return float("inf")
    floor = 1e-4 * max(g.abs().max().item() for g in ref.values())
    return max(
        (got[n] - ref[n]).abs().max().item() / max(ref[n].abs().max().item(), floor) for n in ref
    )


def _buffers(model):
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _put_back(model, buffers):
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])


def buffer_error(model, runner, step):
    """The largest difference of the model's buffers (BatchNorm running statistics, its
    counter) after one step of `runner` from those after one plain step from the same state
    (a recomputed BatchNorm must not update them twice); None when the plain step changes
    none. Runs the plain step, puts the buffers back, then runs `runner`'s."""
    before = _buffers(model)
    _step(model, model, step)
    ref = _buffers(model)
    if all(torch.equal(before[n], ref[n]) for n in ref):
        return None
    _put_back(model, before)
    _step(model, runner, step)
    got = _buffers(model)
    return max((got[n].double() - ref[n].double()).abs().max().item() for n in ref)


def _estimate(model, step):
    """hbp.estimate on the call the step makes, from inside it: the model's forward is
    intercepted, and the estimate runs there (under the step's autocast, if any) on the
    same arguments; the step then stops."""
    result = {}

    class _Stop(Exception):
        pass

    def grab(*args, **kwargs):
        del model.forward  # the class's forward again, for the estimate's capture
        result["estimate"] = hbp.estimate(
            model, *args, budgets=(0.5, "min"), keeps_outputs=False, **kwargs
        )
        raise _Stop

    model.forward = grab
    try:
        step(model)
    except _Stop:
        pass
    finally:
        model.__dict__.pop("forward", None)
    return result["estimate"]


def measure_model(name, build, budgets=(0.5, "min"), compile_too=False):
    """One row of the table: the plain step, the estimate and HCModule at each budget."""
    torch.manual_seed(0)
    model, step = build()
    model.train()
    _step(model, model, step)  # warm-up
    naive, naive_flops, ref = measured(model, model, step)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            est = _estimate(model, step)
        except Exception as e:  # noqa: BLE001 - a failure is a row
            est = None
            est_error = f"{type(e).__name__}: {e}"[:300]
    est_s = time.perf_counter() - t0
    row = {
        "model": name,
        "naive_mib": naive / MIB,
        "estimate_s": est_s,
        "estimate_naive_mib": est.naive_peak_bytes / MIB if est else None,
        "estimate_min_mib": est.min_peak_bytes / MIB if est else None,
        "estimate_error": None if est else est_error,
        "estimate_warnings": [str(w.message)[:200] for w in caught],
        "budgets": [],
    }
    predicted = {p.budget: p.predicted_peak_bytes for p in est.frontier} if est else {}
    print(
        f"{name}: naive {naive / MIB:.2f} MiB; estimate naive "
        f"{row['estimate_naive_mib'] or float('nan'):.2f} min "
        f"{row['estimate_min_mib'] or float('nan'):.2f} ({est_s:.1f} s)",
        flush=True,
    )
    variants = [(b, False) for b in budgets] + ([(0.5, True)] if compile_too else [])
    for budget, compiled in variants:
        r = {"budget": str(budget), "compile": compiled}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hc = hbp.HCModule(model, budget=budget)
            runner = torch.compile(hc) if compiled else hc
            try:
                before = _buffers(model)
                _step(model, model, step)
                ref_buffers = _buffers(model)
                _put_back(model, before)
                t0 = time.perf_counter()
                _step(model, runner, step)
                r["first_step_s"] = time.perf_counter() - t0
                first = _buffers(model)
                if any(not torch.equal(before[n], ref_buffers[n]) for n in before):
                    r["buffer_error_first"] = max(
                        (first[n].double() - ref_buffers[n].double()).abs().max().item()
                        for n in first
                    )
                peak, flops, grads = measured(model, runner, step)
                r["buffer_error"] = buffer_error(model, runner, step)
            except Exception as e:  # noqa: BLE001
                r["error"] = f"{type(e).__name__}: {e}"[:400]
                print(f"  {budget}{' compiled' if compiled else ''}: {r['error']}", flush=True)
                r["warnings"] = [str(w.message)[:300] for w in caught]
                row["budgets"].append(r)
                continue
        plan = hc.plan
        r.update(
            granularity=hc.captured.granularity,
            tracer=getattr(hc.captured, "tracer", None),
            budget_mib=plan.budget_bytes / MIB,
            predicted_mib=plan.predicted_peak_bytes / MIB,
            estimate_predicted_mib=predicted.get(budget, 0) / MIB if budget in predicted else None,
            measured_mib=peak / MIB,
            measured_over_budget=peak / plan.budget_bytes,
            predicted_over_measured=plan.predicted_peak_bytes / peak,
            recompute=flops / naive_flops - 1,
            grad_error=grad_error(grads, ref),
            warnings=[str(w.message)[:300] for w in caught],
        )
        row["budgets"].append(r)
        print(
            f"  {budget}{' compiled' if compiled else ''}: {r['granularity']}/{r['tracer']} "
            f"budget {r['budget_mib']:.2f} pred {r['predicted_mib']:.2f} "
            f"measured {r['measured_mib']:.2f} ({r['measured_over_budget']:.3f}x budget, "
            f"pred/meas {r['predicted_over_measured']:.3f}) rec {r['recompute']:.3f} "
            f"err {r['grad_error']:.1e}{_buffer_note(r)} first step {r['first_step_s']:.1f} s",
            flush=True,
        )
        for w in r["warnings"]:
            print("    warning:", w[:200], flush=True)
    return row


def _buffer_note(r) -> str:
    """`; buffers 0.0e+00/0.0e+00`: the buffer errors of the first and the measured step, for
    models whose step changes buffers (BatchNorm statistics); empty for the others."""
    if r.get("buffer_error") is None and r.get("buffer_error_first") is None:
        return ""
    first, later = r.get("buffer_error_first"), r.get("buffer_error")
    return "; buffers " + "/".join("-" if e is None else f"{e:.1e}" for e in (first, later))


def table(rows) -> str:
    lines = [
        "| model | naive MiB (est.) | budget | budget MiB | measured MiB | meas/budget "
        "| pred/meas | est. pred MiB | recompute | max grad err | first step s | captured by |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        est = row["estimate_naive_mib"]
        naive = f"{row['naive_mib']:.2f} ({est:.2f})" if est else f"{row['naive_mib']:.2f} (-)"
        for r in row["budgets"]:
            label = r["budget"] + (" compiled" if r["compile"] else "")
            if "error" in r:
                lines.append(f"| {row['model']} | {naive} | {label} | {r['error'][:160]} |")
                continue
            ep = r["estimate_predicted_mib"]
            lines.append(
                f"| {row['model']} | {naive} | {label} | {r['budget_mib']:.2f} "
                f"| {r['measured_mib']:.2f} | {r['measured_over_budget']:.3f} "
                f"| {r['predicted_over_measured']:.3f} | {'-' if ep is None else f'{ep:.2f}'} "
                f"| {r['recompute']:.3f} | {r['grad_error']:.1e}{_buffer_note(r)} "
                f"| {r['first_step_s']:.1f} | {_captured_by(r)} |"
            )
    return "\n".join(lines)


def _captured_by(r: dict) -> str:
    """The tracer that captured the model ("fx", "export"), or "module" after the fallback."""
    return r.get("tracer") if r.get("granularity") == "op" else r.get("granularity", "-")
