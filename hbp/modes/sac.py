"""Mode "sac": PyTorch selective activation checkpointing, one checkpointed region per block.

Each of the workload's blocks runs under `torch.utils.checkpoint.checkpoint(use_reentrant=
False)` with `context_fn = create_selective_checkpoint_contexts(policy)`: in forward the
policy marks each aten op's output "save" (kept for backward, not recomputed) or "recompute";
in backward the block's forward runs again, and ops marked "save" return their cached
outputs instead of running. The default policy saves the outputs of matmuls, attention and
convolutions (the expensive ops) and recomputes the cheap rest (norms, activations, adds,
dropout), the trade-off PyTorch's SAC documentation suggests.

Policies (`mode.policy`):
  save_matmuls         save aten mm/addmm/bmm/baddbmm, scaled-dot-product attention kernels and
                       convolution outputs; recompute everything else (default)
  save_attention_only  save only the scaled-dot-product attention kernels' outputs
  recompute_all        save nothing: plain per-block checkpointing through the SAC machinery
  save_all             save everything: no recomputation (naive memory; a sanity baseline)

Recomputation is invisible: the RNG state is replayed (same dropout masks) and normalisation
layers' running statistics are updated once per step: the recompute context combines SAC's
recompute mode with `hbp.runtime.recompute.frozen_running_stats`, so a recomputed BatchNorm
updates throw-away copies of its buffers (a BatchNorm whose output the policy saves is not
run again at all). SAC regions can be backpropagated once (PyTorch raises on a second
backward through a retained graph).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from hbp.errors import ConfigError
from hbp.runtime.recompute import frozen_running_stats, stat_tracking_norms
from hbp.workloads.base import Batch, Workload


def _aten_packets(*names: str) -> frozenset:
    """The aten OpOverloadPackets among `names` that this build of PyTorch has."""
    return frozenset(
        getattr(torch.ops.aten, name) for name in names if hasattr(torch.ops.aten, name)
    )


ATTENTION_OPS = _aten_packets(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
MATMUL_OPS = _aten_packets("mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution")

#: policy name -> the op packets whose outputs are saved (None: every op).
POLICIES: dict[str, frozenset | None] = {
    "save_matmuls": MATMUL_OPS | ATTENTION_OPS,
    "save_attention_only": ATTENTION_OPS,
    "recompute_all": frozenset(),
    "save_all": None,
}


def make_policy_fn(policy: str) -> Callable:
    """The `policy_fn(ctx, op, *args, **kwargs) -> CheckpointPolicy` of a policy name."""
    if policy not in POLICIES:
        raise ConfigError("mode.policy", policy, "one of " + ", ".join(POLICIES))
    saved = POLICIES[policy]

    def policy_fn(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if saved is None or getattr(op, "overloadpacket", None) in saved:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    policy_fn.__name__ = f"sac_policy_{policy}"
    return policy_fn


@contextlib.contextmanager
def _recompute_context(sac_recompute, norms) -> Iterator[None]:
    with frozen_running_stats(norms), sac_recompute:
        yield


class SelectiveCheckpointBlock(nn.Module):
    """One block run as a selectively checkpointed region; `block` is the original module
    (same parameter objects). `state` may be a tensor or a tuple of tensors."""

    def __init__(self, block: nn.Module, policy_fn: Callable, saves_everything: bool = False):
        super().__init__()
        self.block = block
        self._policy_fn = policy_fn
        # SAC refuses to hand back a cached output that an in-place op mutated later (e.g.
        # BatchNorm's output under ResNet's ReLU(inplace=True)). When every op is cached,
        # no op reruns in the recompute, so each cached alias already holds its final value,
        # the one autograd saved in forward: allowing the mutation is then exact.
        self._allow_cache_entry_mutation = saves_everything
        self._norms = stat_tracking_norms(block)

    def _context_fn(self):
        forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(
            self._policy_fn, allow_cache_entry_mutation=self._allow_cache_entry_mutation
        )
        return forward_ctx, _recompute_context(recompute_ctx, self._norms)

    def forward(self, state):
        if not torch.is_grad_enabled():
            return self.block(state)
        return checkpoint(self.block, state, use_reentrant=False, context_fn=self._context_fn)


class SACMode:
    """Selective activation checkpointing per block with a named `policy` (see module doc).

    `chunked_loss` is recorded only: the bench builds the workload with it (GPT-2's chunked
    LM head + cross-entropy) when the workload takes that option."""

    name = "sac"

    def __init__(self, policy: str = "save_matmuls", chunked_loss: bool = False):
        self.policy = policy
        self.policy_fn = make_policy_fn(policy)
        self.chunked_loss = bool(chunked_loss)
        self.num_blocks = 0

    def apply(self, workload: Workload, batch: Batch) -> nn.Module:
        """Replace `workload.model.blocks` by `SelectiveCheckpointBlock`s wrapping the same
        blocks; return the model."""
        workload.require_chain(self.name)
        blocks = list(workload.model.blocks)
        workload.model.blocks = nn.ModuleList(
            SelectiveCheckpointBlock(block, self.policy_fn, POLICIES[self.policy] is None)
            for block in blocks
        )
        self.num_blocks = len(blocks)
        return workload.model

    def describe(self) -> dict:
        saved = POLICIES[self.policy]
        return {
            "name": self.name,
            "policy": self.policy,
            "chunked_loss": self.chunked_loss,
            "num_blocks": self.num_blocks,
            "saved_ops": "all" if saved is None else ",".join(sorted(p.__name__ for p in saved)),
        }
