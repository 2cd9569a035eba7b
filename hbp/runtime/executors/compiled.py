"""Compiled segments: each leaf segment's generated code through `torch.compile` (NOTE
[ Compiled segments ]), for `HCModule(..., compile=True)` and `torch.compile(hc)`."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

# NOTE [ Compiled segments ]
# With `compile_options`, every leaf segment's generated code is compiled on its own
# (`torch.compile(segment, dynamic=False, **options)`); the plan's structure around the
# segments (the executor's environment, nested non-reentrant checkpoints with their
# context_fn, autocast's cache switch) stays eager Python, so memory is still decided by the
# plan: a recomputed segment keeps only its inputs and outputs, whatever its compiled code
# saves inside. One rule makes this exact: a leaf segment always runs the code that returns
# all its forward outputs, also in a recompute pass that needs fewer (the caller drops the
# rest). Eagerly, each variant of the generated code saves the same tensors (autograd saves
# per op); compiled, AOTAutograd's partitioner picks what a graph saves from the graph's
# outputs, so a second variant would save a different number of tensors and non-reentrant
# checkpoint's recompute check would fail. BatchNorm statistics frozen during a recompute
# (`hbp.runtime.recompute`) are buffers swapped on the module: the compiled segment reads
# them as graph inputs, so the swap needs no recompilation. Dropout: the recompute replays the
# RNG state (checkpoint's `preserve_rng_state`); Inductor draws its random numbers from that
# state too, so the recompute's masks are the forward's (the same masks as eager PyTorch
# only with `torch._inductor.config.fallback_random = True`).


def compiled_leaf_call(
    variants: dict[tuple, Callable],
    build: Callable[[tuple], fx.GraphModule],
    options: dict,
    values: list,
    outputs: tuple,
) -> tuple:
    """A leaf segment's call (`segments.LeafCall`) through the one compiled variant that
    returns every output of the forward pass (the first call is the forward: see NOTE
    [ Compiled segments ]). `variants` holds that variant once made, `build(outputs)` makes the
    segment's generated code returning `outputs`, `options` are `torch.compile`'s."""
    if not variants:
        variants[outputs] = torch.compile(build(outputs), **{"dynamic": False, **options})
    ((full, module),) = variants.items()
    if full == outputs:
        return module(values)
    produced = dict(zip(full, module(values)))
    return tuple(produced[n] for n in outputs)
