"""Data-parallel wrappers around the model hbp is given (NOTE [ Data-parallel wrappers ]):
DDP and DataParallel are looked through by `hbp.enable` and refused by `HCModule`; FSDP2 is
planned where it shards the root module only.

    model = inner_model(model)          # hbp.enable(ddp) enables ddp.module
    refuse_parallel_wrappers(module)    # HCModule(ddp), or layers sharded with fully_shard
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from hbp.errors import ConfigError

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch without FSDP2
    FSDPModule = None

__all__ = ["FSDP2_ROOT", "inner_model", "is_fsdp2", "refuse_parallel_wrappers"]

#: Wrappers whose own forward does work around their module's at every call (DDP readies its
#: gradients' all-reduce): hbp goes inside them, not around them.
DATA_PARALLEL = (DistributedDataParallel, DataParallel)

# NOTE [ Data-parallel wrappers ]
# DDP's forward readies its gradient all-reduce at every call (`prepare_for_backward` on the
# reducer, its buffers broadcast) and then calls its module. Captured around DDP, the step's
# first call ran DDP's forward for real but the plan that replaced it from the second call on
# did not: the ranks' gradients were no longer averaged and their weights drifted apart, with
# no error (a new user's trial: `hbp.enable(ddp)`, `HCModule(ddp)`, and `hbp.enable` after
# Accelerate's `prepare` on two processes, whose model is a DDP). hbp belongs inside the
# wrapper: `hbp.enable(ddp)` enables `ddp.module` (DDP's forward calls it, so every call is
# DDP's), and `HCModule(ddp)`, which would have to replace DDP's call, is refused with the two
# orders that work. FSDP2 with `fully_shard` on the root runs its all-gather in hooks around the
# root's call, outside the step hbp captures (its gathered parameters are outside the budget);
# `fully_shard` on layers inside puts collectives and version-counter tricks on every layer's
# call, which no capture can replay, so a module with sharded layers is refused too.


def inner_model(model: nn.Module) -> nn.Module:
    """The module inside a DDP or DataParallel wrapper, else `model`."""
    while isinstance(model, DATA_PARALLEL):
        model = model.module
    return model


def refuse_parallel_wrappers(module: nn.Module) -> None:
    """Raise ConfigError where `module` is a DDP / DataParallel wrapper or has layers sharded
    by FSDP2's `fully_shard` below it (NOTE [ Data-parallel wrappers ])."""
    if isinstance(module, DATA_PARALLEL):
        kind = type(module).__name__
        raise ConfigError(
            "module",
            kind,
            f"the model inside the {kind}: its forward readies the gradients' all-reduce at "
            f"every call, which a plan run in its place would skip; use "
            f"{kind}(HCModule(model)) or hbp.enable(model) before wrapping (hbp.enable of the "
            f"{kind} enables its .module)",
        )
    sharded = [name for name, m in module.named_modules() if name and is_fsdp2(m)]
    if sharded:
        raise ConfigError(
            "module",
            type(module).__name__,
            f"a module without layers sharded by fully_shard, but {', '.join(sharded[:3])} "
            f"{'is' if len(sharded) == 1 else 'are'}: FSDP2 runs collectives in each sharded "
            f"layer's call, which hbp cannot capture; call fully_shard on the root module "
            "only (its all-gathered parameters are outside the budget), or train without hbp",
        )


#: Said once where the root is sharded by FSDP2 (NOTE [ Data-parallel wrappers ]).
FSDP2_ROOT = (
    "the module is sharded by FSDP2's fully_shard: its parameters are all-gathered around "
    "the step hbp plans and measures, so neither the plan nor measured_peak_bytes counts "
    "them (the step's peak is higher by the gathered parameters); leave that memory free "
    "beside the budget"
)


def is_fsdp2(module: nn.Module) -> bool:
    """Whether `module` is sharded by FSDP2's `fully_shard`."""
    return FSDPModule is not None and isinstance(module, FSDPModule)
