"""Why `hbp.estimate` puts BigBird-Pegasus' plain step low (docs/real-models.md): the plain
step's estimate against the allocator's peak with full and with block-sparse attention, then
the block-sparse encoder alone at 1 and 2 layers, with hbp's tensor tracker beside the
allocator and the forward's highest live bytes in the real step and in the simulation.

    OMP_NUM_THREADS=1 python experiments/bigbird_estimate.py

CPU, one thread; random weights, dropout off, 2 x 256 tokens (the zoo's model,
experiments/real_models/seq2seq.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/: `real_models`

from real_models.seq2seq import bigbird_pegasus_config  # noqa: E402

import hbp  # noqa: E402
from hbp.allocator import allocator_peak  # noqa: E402
from hbp.analysis.simulate import simulate  # noqa: E402
from hbp.graph.torch.capture import capture  # noqa: E402
from hbp.integrations.torch.loss import WithLoss  # noqa: E402
from hbp.runtime.tracker import MemoryTracker  # noqa: E402


def model(attention: str, encoder_layers: int = 2):
    import transformers as t

    t.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = bigbird_pegasus_config(attention, encoder_layers)
    return t.BigBirdPegasusForConditionalGeneration(config)


class Encoder(torch.nn.Module):
    """The encoder alone, its last hidden state out."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, ids):
        return self.encoder(input_ids=ids).last_hidden_state


def whole_step(attention: str) -> str:
    net = model(attention)
    ids, labels = torch.randint(3, 512, (2, 256)), torch.randint(3, 512, (2, 16))
    kwargs = dict(input_ids=ids, labels=labels, use_cache=False)
    peak = _peak(net, lambda: net(**kwargs).loss.backward())
    estimate = hbp.estimate(net, budgets=["min"], **kwargs).naive_peak_bytes
    return f"| whole step, {attention} | {peak:,} | {estimate:,} | {peak - estimate:,} | | | |"


def encoder_alone(layers: int) -> str:
    net = Encoder(model("block_sparse", layers).model.encoder)
    ids = torch.randint(3, 512, (2, 256))

    def loss_fn(out):
        return (out**2).mean()

    peak = _peak(net, lambda: loss_fn(net(ids)).backward())
    estimate = hbp.estimate(net, ids, loss_fn=loss_fn, budgets=["min"]).naive_peak_bytes
    net.zero_grad(set_to_none=True)
    with MemoryTracker() as tracker:
        loss_fn(net(ids)).backward()
    timeline = tracker.timeline_frame()
    real_forward = int(timeline[timeline.phase == "forward"]["live_bytes"].max())
    captured = capture(WithLoss(net, loss_fn, 1), (ids,), {})
    simulated = simulate(captured.graph).timeline
    sim_forward = max(b for name, b in simulated if name.startswith("forward"))
    return (
        f"| encoder alone, block_sparse, {layers} layer(s) | {peak:,} | {estimate:,} | "
        f"{peak - estimate:,} | {tracker.peak_bytes:,} | {real_forward:,} | {sim_forward:,} |"
    )


def _peak(net, step) -> int:
    for _ in range(2):
        net.zero_grad(set_to_none=True)
        step()
    net.zero_grad(set_to_none=True)
    return allocator_peak(step)[1]


def main() -> None:
    torch.set_num_threads(1)
    print(
        "| step | allocator peak B | estimate B | allocator - estimate | tracker peak B "
        "| forward's highest live B (real) | (simulated) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for attention in ("original_full", "block_sparse"):
        print(whole_step(attention), flush=True)
    for layers in (1, 2):
        print(encoder_alone(layers), flush=True)


if __name__ == "__main__":
    main()
