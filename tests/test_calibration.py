"""Calibration: the simulator's predicted step peak (`Plan.predicted_peak_bytes`, from the
captured graph, kernel workspace calibrated by `hbp.graph.torch.calibrate`) against the
allocator's peak (`peak_bytes`, docs/architecture.md "Metrics") when HCModule executes that plan, on
models not in the repo (fast) and on the four workloads (slow), naive and under budgets.
Contract: within 3%, and the measured peak within 1.05x the budget."""

import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hbp
import hbp.workloads as workloads
from hbp.allocator import allocator_peak
from hbp.errors import BudgetError
from hbp.ops import chunked_cross_entropy

D, T, V = 64, 32, 256


class TinyGPT(nn.Module):
    """Causal attention + MLP blocks, tied LM head, full-vocabulary cross-entropy (whose
    backward scratch and view gradients the capture has to account for)."""

    def __init__(self, layers=2, chunked=False):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                dict(
                    ln1=nn.LayerNorm(D),
                    qkv=nn.Linear(D, 3 * D),
                    proj=nn.Linear(D, D),
                    ln2=nn.LayerNorm(D),
                    mlp=nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D)),
                )
            )
            for _ in range(layers)
        )
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight
        self.chunked = chunked

    def forward(self, idx, targets):
        x = self.emb(idx)
        b, t, _ = x.shape
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).chunk(3, dim=-1)
            q, k, v = (h.view(b, t, 4, D // 4).transpose(1, 2) for h in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["proj"](y.transpose(1, 2).reshape(b, t, D))
            x = x + blk["mlp"](blk["ln2"](x))
        h = self.ln(x)
        if self.chunked:
            return chunked_cross_entropy(h, self.head.weight, targets, chunk_size=64)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


class ResidualConvNet(nn.Module):
    def __init__(self, width=16, blocks=4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width))
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(width, width, 3, padding=1),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.Conv2d(width, width, 3, padding=1),
                nn.BatchNorm2d(width),
            )
            for _ in range(blocks)
        )
        self.fc = nn.Linear(width, 10)

    def forward(self, x, labels):
        h = F.relu(self.stem(x), inplace=True)
        for block in self.blocks:
            h = F.relu(h + block(h), inplace=True)
        return F.cross_entropy(self.fc(h.mean((2, 3))), labels)


class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            *[m for _ in range(6) for m in (nn.Linear(D, D), nn.GELU(), nn.Dropout(0.2))]
        )

    def forward(self, x, target):
        return F.mse_loss(self.net(x), target)


def measured_vs_predicted(module, inputs, budget, hc=None):
    """(predicted peak, measured peak, budget bytes) of one HCModule step; the loss is the
    module's own output, kept alive through backward. `hc`: an HCModule of `module` that
    has captured these inputs already, planned again for `budget`."""
    if hc is None:
        hc = hbp.HCModule(module, budget)
    else:
        hc.budget = budget
    try:
        plan = hc.prepare(*inputs)
    except BudgetError as err:  # budget below the minimum: plan at the minimum instead
        hc.budget = err.minimum
        plan = hc.prepare(*inputs)
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(0)
    _, measured = allocator_peak(lambda: hc(*inputs).backward())
    return plan.predicted_peak_bytes, measured, plan.budget_bytes


def small_models():
    torch.manual_seed(0)
    idx, targets = torch.randint(0, V, (8, T)), torch.randint(0, V, (8, T))
    return {
        "tiny_gpt": (TinyGPT(), (idx, targets)),
        "tiny_gpt_chunked_ce": (TinyGPT(chunked=True), (idx, targets)),
        "residual_convnet": (
            ResidualConvNet(),
            (torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))),
        ),
        "dropout_mlp": (DropoutMLP(), (torch.randn(512, D), torch.randn(512, D))),
    }


def _cases() -> list:
    cases = []
    for budget in (1.0, 0.5, 0.25):
        for name in small_models():
            marks = [pytest.mark.slow] if budget == 0.25 else []  # slow planning
            cases.append(pytest.param(name, budget, marks=marks, id=f"{budget}-{name}"))
    return cases


@pytest.mark.parametrize("name, budget", _cases())
def test_prediction_matches_measurement_on_models_not_in_the_repo(name, budget):
    module, inputs = small_models()[name]
    predicted, measured, budget_bytes = measured_vs_predicted(module, inputs, budget)
    assert abs(predicted - measured) <= 0.03 * measured, (predicted, measured)
    assert measured <= 1.05 * budget_bytes


class StepModule(nn.Module):
    """A workload's model and loss as one module, so the captured graph is the whole step."""

    def __init__(self, workload, batch):
        super().__init__()
        self.model = workload.model
        self.workload, self.batch = workload, batch

    def forward(self, *args):
        return self.workload.loss_fn(self.model(*args, **self.batch.kwargs), self.batch)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "resnet", "unet", "synthetic_dag"])
def test_prediction_matches_measurement_on_the_workloads(name):
    """In a fresh process: the allocator's peak of a step depends on what the process ran
    before (kernel libraries keep workspace they allocated once: a long test session measured
    the gpt2 step at 0.3 4.7% below the same step in a fresh process, and below its
    prediction), while the per-op workspace calibration is made for a first run."""
    run = subprocess.run(
        [sys.executable, __file__, name], capture_output=True, text=True, timeout=1200
    )
    assert run.returncode == 0, run.stdout + run.stderr


def check_workload(name: str) -> None:
    overrides = {"chunked_loss": True} if name == "gpt2" else {}
    wl = workloads.build(name, "small", seed=0, **overrides)
    batch = wl.make_batch(0)
    module = StepModule(wl, batch)
    rows, hc = [], hbp.HCModule(module)  # one capture, planned at each budget
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for budget in (1.0, 0.5, 0.3, "min"):
            predicted, measured, budget_bytes = measured_vs_predicted(
                module, batch.args, budget, hc
            )
            rows.append((budget, predicted, measured))
            assert abs(predicted - measured) <= 0.03 * measured, rows
            assert measured <= 1.05 * budget_bytes, rows


if __name__ == "__main__":  # one workload's check, in this process (see the test above)
    torch.set_num_threads(1)
    check_workload(sys.argv[1])
