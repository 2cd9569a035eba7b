"""Data-parallel runs: `torchrun --nproc_per_node=N run.py distributed=ddp ...` (or fsdp).

Each rank builds the same model (same seed) and its own batch of the workload's size
(`batch_seed`: seed + rank), so the global batch is N times the workload's and each rank's
step is the single-process step: the memory a mode saves, it saves on every rank. The
gradients are the mean over ranks of each rank's gradients, which is the single-process
gradient of the N batches together (tests/test_distributed.py). The model the mode made is wrapped in
DistributedDataParallel (`ddp`) or sharded in place with FSDP2's `fully_shard` (`fsdp`).
Backend `auto`: nccl where CUDA is available (device cuda:LOCAL_RANK), else gloo. Only rank 0
writes outputs and logs; metrics.json gets `world_size` and the peak of every rank
(`rank_peak_bytes`).

NOTE [ HCModule under DDP and FSDP2 ]
HCModule plans on the first call per input signature, from the module's own parameters.
Under DDP the wrapped module is the HCModule itself: DDP's gradient hooks fire on the same
parameters when the plan's recomputed segments produce their gradients (each parameter's
gradient is made once per step: recompute runs forward ops only). Under FSDP2 the parameters
are swapped for their unsharded copies during forward and backward; the root module keeps
them unsharded from forward to backward, so recomputation in backward reads full parameters.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from hbp.errors import ConfigError

KINDS = ("none", "ddp", "fsdp")
BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class Distributed:
    """This process's place in a data-parallel run (rank 0 of 1 when not distributed)."""

    kind: str = "none"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def check(cfg) -> None:
    """ConfigError for a bad `distributed` group or a combination it does not support."""
    dist_cfg = cfg.get("distributed") or {"name": "none"}
    kind = dist_cfg.get("name", "none")
    if kind not in KINDS:
        raise ConfigError("distributed.name", kind, "one of " + ", ".join(KINDS))
    if kind == "none":
        return
    backend = dist_cfg.get("backend", "auto")
    if backend not in BACKENDS:
        raise ConfigError("distributed.backend", backend, "one of " + ", ".join(BACKENDS))
    if cfg.verify:
        raise ConfigError(
            "verify", True, "false with distributed (tests/test_distributed.py checks gradients)"
        )


def setup(cfg) -> Distributed:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT); a world of one without torchrun."""
    import torch.distributed as dist

    dist_cfg = cfg.get("distributed") or {"name": "none"}
    kind = dist_cfg.get("name", "none")
    if kind == "none":
        return Distributed()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = dist_cfg.get("backend", "auto")
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return Distributed(kind, dist.get_rank(), dist.get_world_size(), local_rank)


def device_for(place: Distributed, device: torch.device) -> torch.device:
    """cuda:LOCAL_RANK for a distributed run on CUDA, else `device`."""
    if place.enabled and device.type == "cuda":
        return torch.device("cuda", place.local_rank)
    return device


def batch_seed(seed: int, place: Distributed) -> int:
    """The seed of this rank's batch: `seed + rank` (rank 0's batch is the single-process one)."""
    return seed + place.rank


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wrap(module: nn.Module, place: Distributed, device: torch.device) -> nn.Module:
    """`module` data-parallel: DistributedDataParallel (ddp) or fully_shard in place (fsdp)."""
    if place.kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids)
    if place.kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        return fully_shard(module)
    return module


def gather(value, place: Distributed) -> list:
    """`value` from every rank, in rank order (a list of one when not distributed)."""
    if not place.enabled:
        return [value]
    import torch.distributed as dist

    values = [None] * place.world_size
    dist.all_gather_object(values, value)
    return values


def teardown(place: Distributed) -> None:
    if place.enabled:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
