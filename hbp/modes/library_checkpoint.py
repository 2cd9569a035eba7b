"""Mode "library_checkpoint": the model library's own activation checkpointing, the baseline a
user of that library reaches with one line.

- transformers: `activation_checkpointing_enable(activation_checkpointing_kwargs=
  {"use_reentrant": False})` (`gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`,
  its deprecated name, where the newer one is missing): every decoder / encoder layer runs under
  `torch.utils.checkpoint.checkpoint`.
- diffusers: `enable_gradient_checkpointing()`: every down, middle and up block (non-reentrant
  `torch.utils.checkpoint`).
- timm: `set_grad_checkpointing(True)`.

The library model is the workload model's `library_model` (hbp.workloads.hf, diffusers_unet)
or the workload model itself. A model whose library has no checkpointing for it (hbp's own
workloads, a transformers class with `supports_gradient_checkpointing = False`) is a
ConfigError that names the workload and the mode to use instead.
"""

from __future__ import annotations

import torch._dynamo  # noqa: F401  checkpoint() imports it on first call: pay that here, untimed
from torch import nn

from hbp.errors import ConfigError
from hbp.workloads.base import Batch, Workload

TRANSFORMERS_KWARGS = {"use_reentrant": False}


def enable_library_checkpointing(model: nn.Module) -> str:
    """Switch on `model`'s own library checkpointing; return how ("transformers
    activation_checkpointing_enable", ...). Raises ConfigError if it has none."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        _require(getattr(model, "supports_gradient_checkpointing", False), model)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=TRANSFORMERS_KWARGS)
        return "transformers activation_checkpointing_enable"
    if hasattr(model, "gradient_checkpointing_enable"):  # transformers < 5
        _require(getattr(model, "supports_gradient_checkpointing", False), model)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=TRANSFORMERS_KWARGS)
        return "transformers gradient_checkpointing_enable"
    if hasattr(model, "enable_gradient_checkpointing"):  # diffusers
        _require(getattr(model, "_supports_gradient_checkpointing", False), model)
        model.enable_gradient_checkpointing()
        return "diffusers enable_gradient_checkpointing"
    if hasattr(model, "set_grad_checkpointing"):  # timm
        model.set_grad_checkpointing(True)
        return "timm set_grad_checkpointing"
    _require(False, model)
    return ""  # unreachable


def _require(ok: bool, model: nn.Module) -> None:
    if not ok:
        raise ConfigError(
            "mode",
            "library_checkpoint",
            f"a workload whose model has its library's own checkpointing (transformers, "
            f"diffusers or timm): {type(model).__name__} has none; use mode=checkpoint "
            f"(uniform checkpointing over the workload's blocks) or mode=tiny",
        )


class LibraryCheckpointMode:
    """The library's own checkpointing switched on; the model is trained as it is."""

    name = "library_checkpoint"

    def __init__(self):
        self.method: str | None = None
        self.library_class: str | None = None

    def apply(self, workload: Workload, batch: Batch) -> nn.Module:
        """Switch the library model's checkpointing on and return the workload's model."""
        model = getattr(workload.model, "library_model", workload.model)
        try:
            self.method = enable_library_checkpointing(model)
        except ConfigError as error:
            raise ConfigError(
                "mode", "library_checkpoint", f"{error.accepted} (workload {workload.name})"
            ) from None
        self.library_class = type(model).__name__
        workload.model.train()
        return workload.model

    def describe(self) -> dict:
        return {"name": self.name, "method": self.method, "library_class": self.library_class}
