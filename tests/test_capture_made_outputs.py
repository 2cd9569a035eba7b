"""NOTE [ Outputs made, not computed ] (hbp.graph.torch.fake): a capture whose tracer and profile
stage make a repeated pure op's output instead of running it gives the same IR, node for node,
and the same fx graph as one that runs every op on fake tensors."""

import pytest
import torch

from hbp.graph.torch import fake, op_profile
from hbp.graph.torch.capture import capture
from tests.models.real import REAL_CASE


@pytest.mark.parametrize(
    "case", [pytest.param("llama", marks=pytest.mark.slow), "alias_then_inplace"]
)
def test_made_outputs_give_the_same_capture(monkeypatch, case):
    torch.manual_seed(0)
    model, args, kwargs = REAL_CASE[case].build()
    made = []
    make = fake.made_output

    def counting(layout, given):
        made.append(layout)
        return make(layout, given)

    monkeypatch.setattr(fake, "made_output", counting)
    monkeypatch.setattr(op_profile, "made_output", counting)
    torch.manual_seed(0)
    with_made = capture(model, args, kwargs)
    for module in (fake, op_profile):  # every op runs
        monkeypatch.setattr(module, "made_layout", lambda out, given: None)
    torch.manual_seed(0)
    run_all = capture(model, args, kwargs)
    assert [n.name for n in with_made.graph.nodes] == [n.name for n in run_all.graph.nodes]
    for a, b in zip(with_made.graph.nodes, run_all.graph.nodes, strict=True):
        assert a == b, a.name
    assert with_made.graph.outputs == run_all.graph.outputs
    assert with_made.gm.code == run_all.gm.code
    if case == "llama":  # repeated layers: outputs were made, not computed
        assert len(made) > len(run_all.graph.nodes) // 4
