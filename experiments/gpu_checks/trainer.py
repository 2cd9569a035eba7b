"""The first contact on a device: a transformers model made hbp's in one line (`hbp.enable`,
its default budget) and trained by transformers' Trainer with its default arguments, against
the same Trainer run on a plain copy of the weights.

    Trainer plain         the reference
    Trainer hbp.enable    hbp.enable(model) with no budget given, then the same Trainer run

Each row: the Trainer run's losses (`losses`; the hbp row's `loss_diff` is the largest relative
difference from plain's, step by step) and its first step's wall time (`first_step_s`:
capture, calibration and planning for hbp), then one step measured after the run (step.py) on
the trained weights: `model(**batch).loss.backward()`, as the Trainer steps. Its gradients
against plain's after the same run are `grad_diff` (a run that drifted apart fails there), its
allocator peak is held to the bytes hbp resolved the default budget to (`budget_bytes`).
"""

from __future__ import annotations

import copy
import math
import tempfile
import time
import traceback
from collections.abc import Callable

import torch

import hbp
from hbp.workloads import build

from .models import _step, plan_fields
from .sizes import ModelSpec
from .step import grad_diff, measure, release

#: Optimizer steps of each Trainer run.
TRAIN_STEPS = 3


def run_trainer_check(spec: ModelSpec, device: str, timed_steps: int, record: Callable) -> None:
    """Plain Trainer, then Trainer on `hbp.enable(model)`; each row passed to `record`."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    workload = build(spec.workload, spec.profile, seed=0, **spec.overrides)
    master = workload.model.library_model
    batch = workload.make_batch(0).to(device)
    rows = _Rows(batch.kwargs, TRAIN_STEPS)
    reference = None
    for variant in ("Trainer plain", "Trainer hbp.enable"):
        row = {"model": spec.describe(), "variant": variant, "dtype": "float32"}
        model = None
        try:
            model = copy.deepcopy(master).to(device)
            if variant != "Trainer plain":
                hbp.enable(model)  # the default budget, as a new user writes it
            with tempfile.TemporaryDirectory() as out:
                losses, first_step_s = _train(transformers, model, rows, out, device)
            params = list(model.parameters())
            measured = measure(
                _step(lambda m: m(**batch.kwargs).loss, model), params, device,
                timed_steps=timed_steps,
            )  # fmt: skip
            row.update(measured.fields(), losses=losses, first_step_s=first_step_s)
            if reference is None:
                reference = row | {"grads": measured.grads}
            else:
                engine = hbp.engine_of(model)
                row.update(plan_fields(engine, engine.budget, reference))  # in bytes as resolved
                row["grad_diff"] = grad_diff(measured.grads, reference["grads"])
                row["loss_diff"] = max(
                    abs(a - b) / abs(b) for a, b in zip(losses, reference["losses"])
                )
                if reference.get("flops") is not None and row.get("flops") is not None:
                    row["recompute_flops"] = row["flops"] - reference["flops"]
                row["note"] = (
                    f"budget {engine.budget}; Trainer losses {_losses(losses)} "
                    f"(plain {_losses(reference['losses'])}); {engine.captured.granularity} capture"
                )
            row["status"] = "ok"
        except Exception as error:  # noqa: BLE001 - recorded as the row's error
            row.update(status="error", error=f"{type(error).__name__}: {error}"[:600])
            row["traceback"] = traceback.format_exc()[-3000:]
        finally:
            model = measured = None
            release(device)
        record(row)
        if reference is None:
            return  # the plain run failed: nothing to compare with


class _Rows(torch.utils.data.Dataset):
    """The batch's rows, repeated for `steps` batches of the batch's size, on the CPU (the
    Trainer's collator stacks them and moves them to the model's device)."""

    def __init__(self, kwargs: dict, steps: int):
        self.columns = {k: v.detach().cpu() for k, v in kwargs.items() if torch.is_tensor(v)}
        self.size = len(next(iter(self.columns.values())))
        self.steps = steps

    def __len__(self) -> int:
        return self.size * self.steps

    def __getitem__(self, index: int) -> dict:
        return {k: v[index % self.size] for k, v in self.columns.items()}


def _train(transformers, model, rows: _Rows, out: str, device: str) -> tuple[list[float], float]:
    """Trainer with its default arguments but for the output, the batch size, the steps, no
    saving, no reporting and no shuffle-dependent workers: (each step's loss, the first step's
    wall time with the device synchronized)."""
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=rows.size, max_steps=rows.steps,
        logging_steps=1, save_strategy="no", report_to="none", seed=0,
        dataloader_num_workers=0, use_cpu=device == "cpu",
    )  # fmt: skip
    timer = _FirstStep(device)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=rows, callbacks=[timer.callback(transformers)]
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, timer.seconds


class _FirstStep:
    """The wall time of the Trainer's first step (its forward, backward and optimizer step)."""

    def __init__(self, device: str):
        self.device, self.started, self.seconds = device, None, math.nan

    def callback(self, transformers):
        timer = self

        class Callback(transformers.TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step == 0:
                    timer.started = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == 1 and timer.started is not None:
                    if timer.device == "cuda":
                        torch.cuda.synchronize()
                    timer.seconds = time.perf_counter() - timer.started

        return Callback()


def _losses(losses: list[float]) -> str:
    return "[" + ", ".join(f"{x:.6f}" for x in losses) + "]"
