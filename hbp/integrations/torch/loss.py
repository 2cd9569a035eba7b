"""The step with its loss: `HCModule(model, loss_fn=...)` plans the loss and its backward with
the module (NOTE [ The step around the module ]); `hbp.estimate(loss_fn=)` estimates the same
step."""

from __future__ import annotations

import inspect

from torch import nn

# NOTE [ The step around the module ]
# A budget is a promise on the whole training step: the module's forward, the caller's loss,
# the loss's backward and the module's backward. The loss runs while everything the module
# saved for backward is alive, and its backward allocates the gradient of the module's outputs
# (e.g. the logits' gradient) at that moment, so it adds to the peak the plan was made for.
# Two ways to keep the promise:
# - `loss_fn`: hbp captures the module and the loss as one graph (`WithLoss`), so the plan
#   sees the loss and its gradients, and can even recompute around them.
# - The closed loop, when hbp cannot see the loss: the first training step of a signature is
#   measured by the allocator (CUDA: `max_memory_allocated`; CPU: profiler memory events),
#   from the start of the forward to the end of the backward (an autograd engine callback
#   queued by a hook on the outputs). If that peak is above the budget, the signature is
#   planned again for the budget minus the excess, with a warning, and the next step is
#   measured again (at most `MAX_REPLANS` times): closed_loop.py.
# - Compiled segments (`compile=`): the plan's cost model is eager autograd's, and Inductor's
#   kernels save and allocate otherwise (a compiled region frees its saved tensors when its
#   whole backward ends); the closed loop measures them the same way.


class WithLoss(nn.Module):
    """`loss_fn(module(*inputs, **kwargs), *targets)` as one module: the first `n_inputs`
    positional arguments are the module's, the rest the targets."""

    wraps_module = True  # messages name `module` (hbp.graph.torch.capture.module_name)

    def __init__(self, module: nn.Module, loss_fn, n_inputs: int):
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn
        self.n_inputs = n_inputs

    def forward(self, *args, **kwargs):
        output = self.module(*args[: self.n_inputs], **kwargs)
        return self.loss_fn(output, *args[self.n_inputs :])


def with_loss(module: nn.Module, loss_fn, args, kwargs) -> tuple[tuple, dict, nn.Module, tuple]:
    """(args, kwargs, root, tag) of the whole step of `module(*args, **kwargs)` whose
    `kwargs["targets"]` (a tensor or a tuple) go to `loss_fn`: the module and `loss_fn` as one
    module taking the inputs followed by the targets; `tag` keys its plans apart."""
    kwargs = dict(kwargs)
    targets = kwargs.pop("targets")
    targets = tuple(targets) if isinstance(targets, (tuple, list)) else (targets,)
    root = WithLoss(module, loss_fn, len(args))
    return (*args, *targets), kwargs, root, ("loss", len(args), id(loss_fn))


# NOTE [ A training step keeps no key/value cache ]
# A transformers decoder's config has `use_cache=True` by default, so a training call
# `model(**batch)` fills a key/value cache layer by layer, which the model holds until its
# forward returns and the caller drops with the output: memory that lives through the forward
# beside the activations, for a step that never reads it. hbp's memory model counts an output
# the caller lets go from its last reader, not until the forward returns, and a Gemma2
# measured 0.72 MiB (8%) above its "min" plan in the forward, a GPT-NeoX 48 KiB. A training
# step of an HCModule (and `hbp.estimate`) therefore passes `use_cache=False` where the
# module's forward takes it, its config turns the cache on and the caller did not pass it:
# as transformers' own gradient checkpointing does (it sets `use_cache=False` while
# training). Both models are then exact (+24 and -4,100 bytes). A caller who passes
# `use_cache=True` gets the cache, and the gap. `use_cache=None` is the config's choice, not
# the caller's: a parent model hands it on so to the decoder `hbp.enable(model.model)` runs,
# whose caches (they require grad) were planned as outputs backward may start from, held
# until it ends (a Persimmon decoder's "min" 22% above the whole model's).


def training_kwargs(module: nn.Module, kwargs: dict) -> dict:
    """`kwargs` for a training step of `module`: with `use_cache=False` where the module's
    forward takes `use_cache` (a PEFT model's, through its base model's), its config has the
    cache on and the caller did not pass it, or passed None (NOTE [ A training step keeps no
    key/value cache ])."""
    if (
        kwargs.get("use_cache") is not None  # None: the config's choice, as not passed
        or getattr(getattr(module, "config", None), "use_cache", None) is not True
    ):
        return kwargs
    return {**kwargs, "use_cache": False} if _takes_use_cache(module) else kwargs


def _takes_use_cache(module: nn.Module) -> bool:
    """Whether `module`'s forward takes `use_cache`: by name, or through `**kwargs` handed to
    the model it wraps (a PEFT model's `get_base_model()`)."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    if "use_cache" in params:
        return True
    passes_on = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    base = module.get_base_model() if passes_on and hasattr(module, "get_base_model") else None
    return isinstance(base, nn.Module) and base is not module and _takes_use_cache(base)
