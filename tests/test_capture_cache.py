"""NOTE [ Identical nodes are profiled once ] (hbp.graph.torch.profile): a capture that takes a
repeated node's profile from its first occurrence gives the same IR, node for node, as one
that profiles every node, on real architectures (repeated layers, dropout, in-place ops,
aliases, BatchNorm's running statistics)."""

import pytest
import torch
from torch import nn

from hbp.graph.torch import op_profile
from hbp.graph.torch.capture import capture
from tests.models.real import REAL_CASE


class ConvNet(nn.Module):
    """Identical conv blocks with BatchNorm (running statistics updated in place) and
    in-place ReLU, then dropout."""

    def __init__(self, blocks: int = 3, width: int = 8):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(width, width, 3, padding=1),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
            )
            for _ in range(blocks)
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(width * 64, 10))

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def captured_both_ways(monkeypatch, model, args, kwargs):
    graphs, hits = [], []
    made = []
    init = op_profile.ProfileCache.__init__

    def recording_init(self):
        init(self)
        made.append(self)

    monkeypatch.setattr(op_profile.ProfileCache, "__init__", recording_init)
    for cached in (True, False):
        monkeypatch.setattr(op_profile, "PROFILE_CACHE", cached)
        torch.manual_seed(0)
        graphs.append(capture(model, args, kwargs).graph)
        hits.append(made[-1].hits if cached else 0)
    return graphs, hits[0]


@pytest.mark.parametrize(
    "case",
    ["gpt2", "llama", "t5", "unet_cond", "alias_then_inplace", "flatten_then_inplace_dropout"],
)
def test_cached_profiles_give_the_same_graph(monkeypatch, case):
    torch.manual_seed(0)
    model, args, kwargs = REAL_CASE[case].build()
    (cached, full), hits = captured_both_ways(monkeypatch, model, args, kwargs)
    assert [n.name for n in cached.nodes] == [n.name for n in full.nodes]
    for a, b in zip(cached.nodes, full.nodes, strict=True):
        assert a == b, a.name
    assert cached.outputs == full.outputs
    if case in ("gpt2", "llama", "t5", "unet_cond"):  # repeated layers: most nodes replayed
        assert hits > len(full.nodes) // 4


def test_cached_profiles_with_batchnorm_and_inplace_ops(monkeypatch):
    torch.manual_seed(0)
    model = ConvNet().train()
    (cached, full), hits = captured_both_ways(monkeypatch, model, (torch.randn(2, 3, 8, 8),), {})
    assert hits > 0
    for a, b in zip(cached.nodes, full.nodes, strict=True):
        assert a == b, a.name
