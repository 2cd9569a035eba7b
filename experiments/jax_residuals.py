"""What reverse mode keeps for one node of the synthetic DAG, torch against JAX (docs/jax.md,
"Why the JAX DAG's naive step is twice torch's").

    python experiments/jax_residuals.py [--batch 512] [--d 64] [--hidden 128]

One `Node` (LayerNorm(h + fc2(gelu(fc1(h))))) of hbp/workloads/synthetic_dag.py and its JAX
twin (hbp/workloads/jax/synthetic_dag.py) with the same weights. Counted: the bytes kept for
the backward, the node's input included and the weights excluded (they exist anyway). torch:
the storages its saved-tensor hooks see (each once); JAX: the residuals of `jax.vjp`, as
`jax.ad_checkpoint.print_saved_residuals` lists them. Prints each residual and the totals.
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np
import torch
from jax._src.ad_checkpoint import saved_residuals  # what print_saved_residuals prints

from hbp.workloads.jax.base import params_from_torch
from hbp.workloads.jax.synthetic_dag import node
from hbp.workloads.synthetic_dag import Node

KIB = 1024


def torch_kept(module: torch.nn.Module, h: torch.Tensor) -> dict[str, int]:
    """Saved storage -> bytes, weights excluded, each storage once."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept: dict[str, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            name = "input h" if storage.data_ptr() == h.untyped_storage().data_ptr() else ""
            kept.setdefault(name or f"{list(t.shape)} at {storage.data_ptr():#x}", storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module([h]).sum()
    return kept


def jax_kept(params: dict, x) -> dict[str, int]:
    """Residual -> bytes, the weights (arguments `params`) excluded."""
    kept: dict[str, int] = {}
    for k, (aval, why) in enumerate(saved_residuals(lambda p, x: node(p, [x]), params, x)):
        if "argument p" not in why:
            kept[f"{k}: {aval.str_short()} {why}"] = int(np.prod(aval.shape)) * aval.dtype.itemsize
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    module = Node(args.d, args.hidden)
    h = torch.randn(args.batch, args.d, requires_grad=True)
    kept = {"torch": torch_kept(module, h)}
    kept["jax"] = jax_kept(params_from_torch(module), jnp.asarray(h.detach().numpy()))
    for side, rows in kept.items():
        print(f"{side}:")
        for name, nbytes in rows.items():
            print(f"  {nbytes / KIB:8.2f} KiB  {name}")
    total = {side: sum(rows.values()) / KIB for side, rows in kept.items()}
    print(
        f"kept: torch {total['torch']:.0f} KiB, jax {total['jax']:.0f} KiB "
        f"({total['jax'] / total['torch']:.1f}x)"
    )


if __name__ == "__main__":
    main()
