"""A call's input signature: what HCModule keeps one capture and plan per. The inputs' shapes,
dtypes, devices and requires_grad, the non-tensor arguments, grad and autocast modes, the
parameters' and buffers' dtypes and devices, the modules' train flags, and the Python state a
capture fixes (NOTE [ What the capture fixed ])."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from hbp.graph.torch.capture import ambient_modes

__all__ = [
    "PLAIN_VALUES",
    "global_hooks",
    "python_state",
    "signature",
    "state_changes",
    "without_python_state",
]


def signature(module: nn.Module, training: bool, args, kwargs) -> tuple:
    """The signature of `module(*args, **kwargs)` (hashable; equal for calls one plan runs)."""
    leaves, spec = tree_flatten((args, dict(sorted(kwargs.items()))))
    parts: list[Any] = [str(spec), training, ambient_modes()]  # grad and autocast
    for x in leaves:
        if isinstance(x, torch.Tensor):
            parts.append((tuple(x.shape), x.dtype, x.device, x.requires_grad, x.is_contiguous()))
        elif x is None or isinstance(x, (bool, int, float, str)):
            parts.append((type(x).__name__, x))
        else:
            parts.append((type(x).__name__, id(x)))
    # .to()/.half() keep the Parameter objects and change their dtype/device. One walk over
    # the modules reads what parameters(), buffers() and modules() would (each walks them
    # again; a step pays this walk on the host).
    params, buffers, flags, state = [], [], [], []
    configs: set[int] = set()
    for i, m in enumerate(module.modules()):
        flags.append(m.training)
        params.extend(
            (id(p), p.requires_grad, p.dtype, p.device)
            for p in m._parameters.values()
            if p is not None
        )
        buffers.extend((id(b), b.dtype, b.device) for b in m._buffers.values() if b is not None)
        state.append(python_state(m, i, configs))
    parts += [tuple(params), tuple(buffers), tuple(flags), tuple(state), global_hooks()]
    return tuple(parts)


def without_python_state(key: tuple) -> tuple:
    """A signature (`signature`) less the modules' Python state: the key under which a capture
    that fixes none of it (NOTE [ Module calls fix no Python state ]) is found."""
    return key[:-2] + key[-1:]


# NOTE [ Module calls fix no Python state ]
# A module-level capture checkpoints whole calls of the repeated blocks and runs every
# module's own forward at each step; a signature no capture reaches runs the plain module.
# Neither fixes the Python state a forward reads: it is read anew at every call. So a change
# of that state alone is no new signature for them, and they are found under the signature
# less it (`without_python_state`). Reformer, which falls back to module level, writes fresh
# hash seeds on its layers at every call: each step was a new signature, captured and
# planned again. The plan's memory is the state of its first call's, as the closed loop
# measured it.


#: Attribute values a forward can branch on, compared from step to step (NOTE [ What the
#: capture fixed ]).
PLAIN_VALUES = (bool, int, float, str, type(None))
#: A transformers config's records of its checkpoint, not what a forward reads: the classes
#: and the dtype its weights were saved as (`save_pretrained` sets them, from None: a
#: Trainer's first checkpoint made every shape a new signature, captured again; the
#: parameters' dtypes are in the signature already).
CONFIG_RECORDS = frozenset({"architectures", "dtype", "torch_dtype", "transformers_version"})


def python_state(module: nn.Module, index: int, configs: set[int]) -> tuple:
    """What of `module`'s Python state a captured graph fixed: its hooks' handles and its
    public attributes of plain values, with those of its `config` (a transformers model's, read
    once however many modules hold it: `configs` has the ids of those read)."""
    state = [(k, v) for k, v in module.__dict__.items() if type(v) in PLAIN_VALUES and k[0] != "_"]
    if module._forward_hooks or module._forward_pre_hooks:
        state.append((tuple(module._forward_hooks), tuple(module._forward_pre_hooks)))
    config = module.__dict__.get("config")
    if config is not None and id(config) not in configs and hasattr(config, "__dict__"):
        configs.add(id(config))
        state += [
            (f"config.{k}", v)
            for k, v in vars(config).items()
            if type(v) in PLAIN_VALUES and k not in CONFIG_RECORDS
        ]
    return (index, *state) if state else ()


def global_hooks() -> tuple:
    """The handles of the forward hooks registered for every module (`torch.nn.modules.module.
    register_module_forward_hook`), which a capture runs as part of each module's call."""
    from torch.nn.modules import module as torch_module

    return (
        tuple(torch_module._global_forward_hooks),
        tuple(torch_module._global_forward_pre_hooks),
    )


# NOTE [ What the capture fixed ]
# A capture traces the forward's Python once per input signature: the branches it took on
# attributes (`config.output_hidden_states`, a user's `self.scale`, the `p` a transformers
# model hands to functional dropout) and the forward hooks it ran are fixed in the graph. So
# the signature also holds, per module, the public attributes of plain values, its config's,
# and its hooks' handles (and the global module hooks'): a change between steps is a new
# signature, captured and planned on its next call (a change back finds the first plan). A
# hook added to a submodule after the first step was silently not run, and one removed still
# ran; a dropout rate set to 0 kept the old rate. The walk is the one the signature already
# makes over the modules (about 1 ms on a 32-layer Llama's 423 modules on this CPU). Python
# state outside the modules (a global, a closure) is not seen: `hbp.enable` again captures
# anew. A forward that sets its own attributes while traced (a rotary cache's length) is
# found under the state the capture left too. A new capture for a change of state alone warns
# once per set of names, with the values ("step 0 -> 1"): an attribute the forward does not
# read (a step counter the loop keeps on the model) is then better named with a leading
# underscore, which is not followed.


def state_changes(before: tuple, after: tuple, module: nn.Module) -> list[str]:
    """What of the Python state differs between two signatures that differ in nothing else
    ("blocks.0.scale 1.0 -> 0.5", "the forward hooks of blocks.1"); [] where anything else
    differs too (the inputs, the parameters, the set of modules)."""
    if before[:-2] != after[:-2] or len(before[-2]) != len(after[-2]):
        return []
    names = None
    out = []
    for old, new in zip(before[-2], after[-2]):
        if old == new:
            continue
        if names is None:
            names = [name for name, _ in module.named_modules()]
        index = (old or new)[0]
        where = names[index] if index < len(names) else "?"
        old_attrs = {k: v for k, v in old[1:] if isinstance(k, str)}
        new_attrs = {k: v for k, v in new[1:] if isinstance(k, str)}
        for key in dict.fromkeys([*old_attrs, *new_attrs]):
            if old_attrs.get(key, None) != new_attrs.get(key, None):
                out.append(
                    f"{where + '.' if where else ''}{key} "
                    f"{old_attrs.get(key)!r} -> {new_attrs.get(key)!r}"
                )
        if [p for p in old[1:] if not isinstance(p[0], str)] != [
            p for p in new[1:] if not isinstance(p[0], str)
        ]:
            out.append(f"the forward hooks of {where or 'the module'}")
    if before[-1] != after[-1]:
        out.append("the global module hooks")
    return out
