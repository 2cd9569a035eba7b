"""FLOP formulas one definition of FLOPs uses everywhere (docs/architecture.md "Metrics": `flops`).

FLOPs are counted per aten op from shapes by `torch.utils.flop_counter` (a matmul of
(m, k) @ (k, n) is 2·m·k·n); ops without a formula (elementwise, reductions) count 0.
`FLOP_FORMULAS` adds the CPU kernels `FlopCounterMode` has no formula for: flash attention
(what `F.scaled_dot_product_attention` runs on CPU), oneDNN's LSTM layer (what `nn.LSTM` runs
on CPU) and the in-place matmuls. The capture counts every node with `TotalFlopCounterMode`,
and the measured step (`hbp.runtime.flops`) with the same mode, so predicted and measured
FLOPs follow one definition.
"""

from __future__ import annotations

import math

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode

__all__ = ["FLOP_FORMULAS", "TotalFlopCounterMode"]

_aten = torch.ops.aten


def sdpa_cpu_flash_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kw) -> int:
    """`aten._scaled_dot_product_flash_attention_for_cpu`: as every SDPA kernel,
    2·b·h·s_q·s_k·(d_qk + d_v) (`flop_counter.sdpa_flop_count`)."""
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def sdpa_cpu_flash_backward_flops(
    grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kw
) -> int:
    """Its backward: `flop_counter.sdpa_backward_flop_count` (2.5x the forward)."""
    return flop_counter.sdpa_backward_flop_count(
        grad_out_shape, query_shape, key_shape, value_shape
    )


def _rnn_layer_matmul_flops(input_shape, w_ih_shape, w_hh_shape) -> int:
    """One RNN layer's two matmuls per step: 2·(batch·steps)·gates·(input + hidden)."""
    steps = math.prod(input_shape[:-1])  # batch x sequence, either layout
    gates, inputs = w_ih_shape
    return 2 * steps * gates * (inputs + w_hh_shape[1])


def mkldnn_rnn_layer_flops(input_shape, w_ih_shape, w_hh_shape, *args, out_shape=None, **kw):
    """`aten.mkldnn_rnn_layer` (one layer, one direction of nn.LSTM on CPU): its matmuls
    (gate nonlinearities are elementwise and count 0, as everywhere)."""
    return _rnn_layer_matmul_flops(input_shape, w_ih_shape, w_hh_shape)


def mkldnn_rnn_layer_backward_flops(input_shape, w_ih_shape, w_hh_shape, *args, **kw):
    """Its backward: twice the forward (gradients of the inputs and of the weights)."""
    return 2 * _rnn_layer_matmul_flops(input_shape, w_ih_shape, w_hh_shape)


def addmm_inplace_flops(self_shape, a_shape, b_shape, *args, out_shape=None, **kw) -> int:
    """`aten.addmm_` (accumulating a matmul in place, e.g. a chunked weight gradient): the
    matmul's 2·m·k·n, as `addmm` (FlopCounterMode only knows the out-of-place op)."""
    return flop_counter.addmm_flop(self_shape, a_shape, b_shape)


def baddbmm_inplace_flops(self_shape, a_shape, b_shape, *args, out_shape=None, **kw) -> int:
    """`aten.baddbmm_`: as `baddbmm`."""
    return flop_counter.baddbmm_flop(self_shape, a_shape, b_shape)


#: aten op -> FLOP formula (on shapes, `FlopCounterMode(custom_mapping=...)` convention).
FLOP_FORMULAS = {
    _aten.addmm_: addmm_inplace_flops,
    _aten.baddbmm_: baddbmm_inplace_flops,
    _aten._scaled_dot_product_flash_attention_for_cpu: sdpa_cpu_flash_flops,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_cpu_flash_backward_flops,
    _aten.mkldnn_rnn_layer: mkldnn_rnn_layer_flops,
    _aten.mkldnn_rnn_layer_backward: mkldnn_rnn_layer_backward_flops,
}


class TotalFlopCounterMode(FlopCounterMode):
    """`FlopCounterMode` (with `FLOP_FORMULAS`) that counts only the total ("Global").

    FlopCounterMode's ModuleTracker registers grad hooks on every module's outputs, also on
    outputs recomputed by torch.utils.checkpoint, and those hooks keep tensors alive until the
    garbage collector runs: stacked with a memory measurement it inflates the peak (by
    hundreds of KiB on an 8-block checkpointed MLP, and by a gc-dependent amount). This mode
    installs no hooks and holds no tensor, so it can share a step with `MemoryTracker` or
    the CUDA allocator statistics; the capture counts every node's FLOPs with it too.
    """

    def __init__(self):
        super().__init__(display=False, custom_mapping=FLOP_FORMULAS)

    def __enter__(self):
        self.flop_counts.clear()
        self.mode = _FlopCounterMode(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *args):
        exited = self.mode.__exit__(*args)
        self.mode = None
        return exited
