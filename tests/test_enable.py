"""`hbp.enable(model, budget=...)` in place, and the transparent `HCModule`: the model keeps its
class, forward signature, parameters, state_dict keys, hooks, save_pretrained/from_pretrained
and generate; training steps are the plain model's (same loss and gradients) within the
budget; `hbp.disable` restores it."""

import copy
import inspect
import pickle
import warnings

import pytest
import torch
from torch import nn

import hbp
from hbp.allocator import allocator_peak
from hbp.errors import CaptureWarning
from hbp.integrations.torch.enable import is_enabled
from tests.models.real import gpt2, llama


def _same_grads(a: nn.Module, b: nn.Module, exact: bool = True) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if exact:
            assert torch.equal(p.grad, q.grad), name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def _step(model, kwargs, seed=0):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = model(**kwargs).loss
    loss.backward()
    return loss.detach()


def test_enable_in_place_keeps_the_model_and_its_step():
    torch.manual_seed(0)
    plain, _, kwargs = gpt2()
    model = copy.deepcopy(plain)
    signature, keys = inspect.signature(model.forward), list(model.state_dict())
    n_modules = len(list(model.modules()))
    assert hbp.enable(model, budget="min") is model
    assert hbp.enable(model, budget="min") is model  # idempotent
    assert type(model) is type(plain) and len(list(model.modules())) == n_modules
    assert inspect.signature(model.forward) == signature
    assert list(model.state_dict()) == keys
    for step in range(2):
        assert torch.equal(_step(plain, kwargs, step), _step(model, kwargs, step))
        _same_grads(plain, model)
    engine = hbp.engine_of(model)
    assert engine.captured.granularity == "op" and engine.plan.predicted_recompute_flops > 0
    measured = allocator_peak(lambda: _step(model, kwargs))[1]
    assert measured <= 1.05 * engine.plan.budget_bytes, (measured, engine.plan.budget_bytes)


def test_no_grad_calls_and_generate_run_the_plain_forward(count_captures):
    torch.manual_seed(0)
    model, _, kwargs = gpt2()
    captures = count_captures()
    hbp.enable(model)
    with torch.no_grad():
        out = model.generate(kwargs["input_ids"][:, :4], max_new_tokens=3, do_sample=False)
        model(**kwargs)
    assert out.shape == (4, 7) and captures == []
    _step(model, kwargs)
    assert captures == [1]


def test_disable_restores_the_forward_and_enable_replaces_the_budget():
    torch.manual_seed(0)
    model, _, kwargs = gpt2()
    forward = model.forward
    hbp.enable(model, budget=0.9)
    hbp.enable(model, budget="min")
    assert hbp.engine_of(model).budget == "min"
    assert hbp.disable(model) is model
    assert "forward" not in model.__dict__ and hbp.engine_of(model) is None
    hc = hbp.HCModule(model)
    assert hbp.engine_of(hc) is hc  # a wrapper is its own engine
    assert model.forward == forward
    hbp.disable(model)  # idempotent


def test_enable_again_with_another_budget_plans_the_capture_again(count_captures):
    """`hbp.enable` with only another budget (or block_size, planner) keeps the engine and its
    captures; other options make a new engine."""
    torch.manual_seed(0)
    model, _, kwargs = gpt2()
    reference = copy.deepcopy(model)
    captures = count_captures()
    hbp.enable(model, budget=1.0)
    _step(model, kwargs)
    engine, naive = hbp.engine_of(model), hbp.engine_of(model).compiled.naive_peak_bytes
    hbp.enable(model, budget=0.5, block_size=2)
    assert torch.equal(_step(reference, kwargs), _step(model, kwargs))
    _same_grads(reference, model)
    assert hbp.engine_of(model) is engine and captures == [1]
    assert engine.plan.budget_bytes == int(0.5 * naive) and engine.plan.meta["block_size"] == 2
    engine.budget = 0.3  # set on the engine: enable("min") still plans "min"
    hbp.enable(model, budget="min", block_size=2)
    assert hbp.engine_of(model) is engine and engine.budget == "min"
    with pytest.raises(hbp.ConfigError, match="block_size"):
        hbp.enable(model, budget=0.5, block_size=0)
    assert (engine.budget, engine.block_size) == ("min", 2)  # all or nothing
    hbp.enable(model, budget=0.5, keeps_outputs=True)
    assert hbp.engine_of(model) is not engine
    _step(model, kwargs)
    assert captures == [1, 1]


def test_enable_on_a_submodule_and_hooks_run_once():
    """`hbp.enable(model.model)`: the decoder alone, under the model's own head and loss. Its
    own hooks run once per step, and no warning says otherwise."""
    torch.manual_seed(0)
    plain, _, kwargs = llama()
    model = copy.deepcopy(plain)
    calls = []
    model.model.register_forward_hook(lambda *args: calls.append(1))
    model.model.register_forward_pre_hook(lambda *args: calls.append(0))
    hbp.enable(model.model, budget="min")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            torch.testing.assert_close(_step(plain, kwargs, step), _step(model, kwargs, step))
            _same_grads(plain, model, exact=False)
    assert calls == [0, 1, 0, 1]
    assert not [w for w in caught if "hooks" in str(w.message)], [str(w.message) for w in caught]
    assert hbp.engine_of(model.model).captured.granularity == "op"


def test_a_wrapper_of_an_enabled_model_finds_its_engine_and_disables_it():
    """Enabled before `get_peft_model` (or any wrapper): `engine_of(wrapper)` is the enabled
    module's engine and `disable(wrapper)` undoes it; with two enabled modules inside,
    `engine_of` names neither and `disable` undoes both."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    plain, _, kwargs = llama()
    base = copy.deepcopy(plain)
    hbp.enable(base, budget="min")
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    _step(model, kwargs)
    engine = hbp.engine_of(model)
    assert engine is hbp.engine_of(base) and engine.plan is not None
    assert not is_enabled(model)
    hbp.disable(model)
    assert not is_enabled(base) and hbp.engine_of(model) is None
    assert type(base).forward is base.forward.__func__  # the class's own forward again

    two = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
    hbp.enable(two["a"])
    hbp.enable(two["b"])
    assert hbp.engine_of(two) is None
    hbp.disable(two)
    assert not is_enabled(two["a"]) and not is_enabled(two["b"])


def test_two_modules_enabled_one_by_one_are_named_in_the_over_budget_warning():
    """NOTE [ Other engines in the step ]: an encoder's measured step holds the decoder's
    activations, enabled on its own; the warning says so instead of advising `loss_fn=`."""
    torch.manual_seed(0)

    def mlp():
        return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(256, 256), nn.Tanh())])

    model = nn.ModuleDict({"encoder": mlp(), "decoder": mlp()})
    hbp.enable(model["encoder"], budget="min")
    hbp.enable(model["decoder"], budget="min")
    x = torch.randn(512, 256)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model["decoder"](model["encoder"](x)).square().mean().backward()
    said = [str(w.message) for w in caught if issubclass(w.category, hbp.BudgetWarning)]
    assert any("Another module run by hbp was called within this step" in m for m in said), said


def test_training_through_methods_other_than_forward_is_warned_once():
    """NOTE [ Training that goes around forward ]: a VAE trained through `encode` and
    `decode` never calls the forward `enable` replaced; a warning says so once. A model
    trained through its forward is not warned, nor one disabled before its backward."""

    class VAE(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.decoder = nn.Linear(16, 4), nn.Linear(4, 16)

        def encode(self, x):
            return self.encoder(x)

        def decode(self, z):
            return self.decoder(z)

        def forward(self, x):
            return self.decode(self.encode(x))

    x = torch.randn(8, 16)
    for through_forward in (False, True):
        model = hbp.enable(VAE())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                out = model(x) if through_forward else model.decode(model.encode(x))
                out.square().mean().backward()
        said = [str(w.message) for w in caught if "forward was not called" in str(w.message)]
        assert len(said) == (0 if through_forward else 1), said
    model = hbp.enable(VAE())
    hbp.disable(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.decode(model.encode(x)).sum().backward()
    assert not [w for w in caught if "forward was not called" in str(w.message)]


def test_a_model_with_an_enabled_submodule_is_refused_with_what_to_do():
    """NOTE [ One engine per step ]: enabling (or wrapping) a model whose submodule is enabled
    traced one engine into the other and fell back to module level with internal warnings;
    now one ConfigError names the submodule and the way out, and the way out trains."""
    torch.manual_seed(0)
    plain, _, kwargs = llama()
    model = copy.deepcopy(plain)
    hbp.enable(model.model, budget="min")
    for wrap in (hbp.enable, hbp.HCModule):
        with pytest.raises(hbp.ConfigError, match=r"but model is already enabled .*hbp\.disable"):
            wrap(model, "min")
    assert not is_enabled(model)  # as it was: the submodule's engine is the one
    assert hbp.engine_of(model) is hbp.engine_of(model.model) is not None
    hbp.disable(model.model)
    hbp.enable(model, budget="min")
    torch.testing.assert_close(_step(plain, kwargs), _step(model, kwargs))
    _same_grads(plain, model, exact=False)
    assert hbp.engine_of(model).captured.granularity == "op"


def test_an_hcmodule_says_the_wrapped_models_own_hooks_do_not_run():
    """Unlike an enabled model, an HCModule runs its captured graph, not the wrapped model's
    call: the model's own hooks do not run, and it says so once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    hc = hbp.HCModule(model, budget="min", calibrate=False)
    with pytest.warns(UserWarning, match="hooks registered on the wrapped Sequential itself"):
        hc(torch.randn(32, 16)).sum().backward()
    assert calls == []


def test_save_pretrained_from_pretrained_deepcopy_and_pickle(tmp_path):
    torch.manual_seed(0)
    model, _, kwargs = gpt2()
    hbp.enable(model, budget="min")
    _step(model, kwargs)
    model.save_pretrained(tmp_path)  # sets config.architectures and config.dtype
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "config.dtype None -> 'float32' since ..."
        _step(model, kwargs)
    assert len(hbp.engine_of(model)._captures()) == 1  # not captured again (CONFIG_RECORDS)
    loaded = type(model).from_pretrained(tmp_path)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    twin = copy.deepcopy(model)
    assert hbp.engine_of(twin).module is twin
    again = pickle.loads(pickle.dumps(model))
    assert hbp.engine_of(again).module is again
    torch.testing.assert_close(_step(model, kwargs), _step(again, kwargs))


def test_hcmodule_is_transparent(tmp_path):
    torch.manual_seed(0)
    model, _, kwargs = gpt2()
    hc = hbp.HCModule(model, budget="min")
    assert inspect.signature(hc.forward) == inspect.signature(model.forward)
    assert hc.config is model.config and hc.device == model.device and hc.dtype == model.dtype
    assert set(hc.state_dict()) == set(model.state_dict())
    hc.load_state_dict(model.state_dict())
    hc.load_state_dict({f"module.{k}": v for k, v in model.state_dict().items()})
    _step(hc, kwargs)
    hc.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.parameters()))
    with torch.no_grad():
        assert hc.generate(kwargs["input_ids"][:, :4], max_new_tokens=2).shape == (4, 6)
    with pytest.raises(AttributeError):
        hc.no_such_attribute  # noqa: B018


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x).relu()
        if h.sum() > 0:  # data-dependent control flow: no op-level capture
            h = h * 2
        return self.b(h)


def test_the_tracer_after_the_module_level_fallback_has_a_name():
    hc = hbp.HCModule(DataDependent(), budget="min")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CaptureWarning)
        hc(torch.randn(4, 8)).sum().backward()
    assert hc.captured.granularity == "module" and hc.captured.tracer == "module"


def test_an_autocast_forward_set_before_enable_runs_around_the_training_step():
    """NOTE [ A forward wrapped before enable ]: a forward set on the instance as the class's
    forward inside `torch.autocast` (what accelerate's mixed precision does) keeps its autocast
    in the enabled model's training steps, and in an HCModule's over it: the plain wrapped
    model's losses and gradients, not the fp32 ones."""
    torch.manual_seed(0)
    fp32, _, kwargs = gpt2()
    plain, model, wrapped = (copy.deepcopy(fp32) for _ in range(3))
    for net in (plain, model, wrapped):
        net.forward = torch.autocast("cpu", dtype=torch.bfloat16)(net.forward)
    hbp.enable(model, budget="min")
    hc = hbp.HCModule(wrapped, budget="min")  # an HCModule over it runs the layers too
    for step in range(2):
        loss = _step(model, kwargs, step)
        assert torch.equal(_step(plain, kwargs, step), loss)
        assert not torch.equal(_step(fp32, kwargs, step), loss)  # bf16 it is
        _same_grads(plain, model)
        assert torch.equal(_step(hc, kwargs, step), loss)
        _same_grads(plain, wrapped)
    assert hbp.engine_of(model).plan.predicted_recompute_flops > 0
    assert hc.plan.predicted_recompute_flops > 0


def test_an_unknown_forward_set_before_enable_is_named_in_a_warning():
    """A forward another library or the user set on the instance, which hbp does not know,
    is not guessed at: enable says the training steps run the class's forward without it, and
    calls without grad still run it."""
    torch.manual_seed(0)
    model, _, kwargs = gpt2()
    original, calls = model.forward, []

    def logged(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    model.forward = logged
    with pytest.warns(
        UserWarning,
        match=r"hbp.enable: .*replaced by .*logged before hbp saw it.*before the library",
    ):
        hbp.enable(model, budget="min")
    _step(model, kwargs)
    assert calls == []
    with torch.no_grad():
        model(**kwargs)
    assert calls == [1]
    assert hbp.disable(model).forward is logged


def test_a_data_parallel_wrapper_is_enabled_inside_and_refused_by_hcmodule():
    """NOTE [ Data-parallel wrappers ]: `hbp.enable` of a DataParallel / DDP enables its
    `.module` (the wrapper's forward, which readies DDP's all-reduce, runs at every call);
    `HCModule` over one is refused with the orders that work."""
    from hbp.integrations.torch.enable import is_enabled

    torch.manual_seed(0)
    plain, _, kwargs = gpt2()
    model = copy.deepcopy(plain)
    wrapper = nn.DataParallel(model)
    assert hbp.enable(wrapper, budget="min") is wrapper
    assert is_enabled(wrapper) and is_enabled(model)
    assert hbp.engine_of(wrapper) is hbp.engine_of(model)
    for step in range(2):
        assert torch.equal(_step(plain, kwargs, step), _step(wrapper, kwargs, step))
        _same_grads(plain, model)
    assert hbp.engine_of(model).plan.predicted_recompute_flops > 0
    with pytest.raises(hbp.ConfigError, match=r"DataParallel\(HCModule\(model\)\)"):
        hbp.HCModule(nn.DataParallel(copy.deepcopy(plain)))
    hbp.disable(wrapper)
    assert not is_enabled(model)


def test_is_enabled_is_public():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert not hbp.is_enabled(model)
    hbp.enable(model)
    assert hbp.is_enabled(model)
    hbp.disable(model)
    assert not hbp.is_enabled(model)
