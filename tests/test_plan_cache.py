"""HCModule keeps plans on disk (`plan_cache=`) and writes one plan (`save_plan`): a second
module of the same structure reads its plan back instead of planning, with the same plan, the
same gradients and the budget held."""

import pytest
import torch
from torch import nn

import hbp
from hbp.planner.cache import load_plan


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(6)]
    )


def test_plan_cache_reads_the_plan_back_for_the_same_structure(tmp_path):
    x = torch.randn(1024, 64)
    first = hbp.HCModule(_model(), budget="50%act", plan_cache=tmp_path)
    first(x).square().mean().backward()
    assert not first.plan.meta.get("from_cache")
    assert list(tmp_path.iterdir()), "the plan was not written"

    plain = _model(seed=1)
    second = hbp.HCModule(_model(seed=1), budget="50%act", plan_cache=tmp_path)
    second(x).square().mean().backward()
    assert second.plan.meta.get("from_cache") is True
    assert second.plan.segments == first.plan.segments
    assert any(s.recompute for s in second.plan.segments)
    plain(x).square().mean().backward()
    for p, q in zip(second.module.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    peak = hbp.measure_step(lambda: second(x).square().mean().backward(), params=second.module)
    assert peak.peak_bytes <= 1.05 * second.plan.budget_bytes

    other_budget = hbp.HCModule(_model(), budget="min", plan_cache=tmp_path)
    other_budget(x).square().mean().backward()
    assert not other_budget.plan.meta.get("from_cache")  # another budget: planned


def test_save_plan_writes_a_plan_that_loads_for_its_graph(tmp_path):
    hc = hbp.HCModule(_model(), budget="50%act")
    try:
        hc.save_plan(tmp_path / "none.json")
    except RuntimeError as err:
        assert "nothing is planned yet" in str(err)
    else:
        raise AssertionError("save_plan before a step must raise")
    hc(torch.randn(1024, 64)).square().mean().backward()
    hc.save_plan(tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json", hc.captured.graph)
    assert loaded.segments == hc.plan.segments


def test_a_cache_that_cannot_be_written_warns_once_and_the_step_is_the_same(tmp_path):
    """A file where the cache folder should be (as a read-only or full disk): the plan and the
    workspaces are not kept, one `CacheWarning` says so, and the step trains as without a
    cache."""
    import warnings

    import hbp.files

    hbp.files._WARNED.clear()
    blocked = tmp_path / "cache"
    blocked.write_text("not a folder")
    x = torch.randn(1024, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hc = hbp.HCModule(_model(), budget="50%act", plan_cache=blocked)
        hc(x).square().mean().backward()
    said = [w for w in caught if issubclass(w.category, hbp.CacheWarning)]
    assert len(said) == 1 and f"under {blocked} (" in str(said[0].message)  # the cache itself
    plain = _model()
    plain(x).square().mean().backward()
    for p, q in zip(hc.module.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert blocked.read_text() == "not a folder"


def test_a_restarted_job_starts_from_the_plan_its_measurements_settled_on(tmp_path):
    """A caller that keeps the outputs (`out = model(...); out.loss.backward()`): the first
    job learns it at its second step and plans again; that plan is kept, so a restarted job
    runs it from its first step: no warning, nothing planned, the outputs counted, the
    budget held as measured."""
    import warnings

    from tests.models.toy import TinyLM

    torch.manual_seed(0)
    ids, labels = torch.randint(0, 2048, (256,)), torch.randint(0, 2048, (256,))

    def keep(hc):
        out = hc(ids, labels)
        out.loss.backward()
        return out

    first = hbp.HCModule(TinyLM(), budget="50%act", plan_cache=tmp_path)
    keep(first)
    with pytest.warns(UserWarning, match="the caller keeps output.logits"):
        keep(first)
    settled = first.plan

    restarted = hbp.HCModule(TinyLM(), budget="50%act", plan_cache=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no closed-loop or kept-outputs warning
        keep(restarted)
        peak = restarted.measured_peak_bytes  # its first step, measured by the allocator
        keep(restarted)
    assert restarted.plan.meta.get("from_cache") is True
    assert restarted.plan.segments == settled.segments
    assert restarted.captured.graph.held_outputs == first.captured.graph.held_outputs
    assert len(restarted.captured.graph.held_outputs) == 2  # the loss and the logits
    assert peak <= 1.05 * restarted.plan.budget_bytes


@pytest.mark.parametrize(
    "text",
    ["null", "5", '"budget_error"', '{"budget_error": {}}', '{"plan": {"segments": []}}', "{"],
)
def test_an_entry_that_is_not_a_plan_is_a_miss_and_is_written_again(tmp_path, text):
    x = torch.randn(256, 64)
    hbp.HCModule(_model(), budget="50%act", plan_cache=tmp_path)(x).sum().backward()
    (entry,) = tmp_path.glob("*.json")
    entry.write_text(text)
    again = hbp.HCModule(_model(), budget="50%act", plan_cache=tmp_path)
    again(x).sum().backward()
    assert not again.plan.meta.get("from_cache")
    assert '"plan"' in entry.read_text() and entry.read_text() != text


def test_plan_cache_is_checked_and_enabling_again_without_it_keeps_the_captures(
    tmp_path, count_captures
):
    with pytest.raises(hbp.ConfigError, match="plan_cache"):
        hbp.HCModule(_model(), plan_cache="")
    model, x = _model(), torch.randn(256, 64)
    hbp.enable(model, budget="50%act", plan_cache=tmp_path)
    model(x).sum().backward()
    captures = count_captures()
    hbp.enable(model, budget=0.8)  # a plan option changed, the cache dropped: no new capture
    model(x).sum().backward()
    assert captures == [] and hbp.engine_of(model).plan_cache is None
    hbp.enable(model, budget=0.8, plan_cache=tmp_path)
    model(x).sum().backward()
    assert captures == [] and hbp.engine_of(model).plan_cache.directory == tmp_path
