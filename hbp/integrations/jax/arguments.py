"""Arguments like `jax.grad` takes them: argnums, static leaves, keyword arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from hbp.errors import ConfigError
from hbp.graph.jax_capture import Program


def check_argnums(argnums):
    """`argnums` as an int or a non-empty tuple of ints (a list becomes a tuple, as in
    `jax.grad`); anything else raises ConfigError."""
    if isinstance(argnums, list):
        argnums = tuple(argnums)
    ok = isinstance(argnums, int) or (
        isinstance(argnums, tuple)
        and len(argnums) > 0
        and all(isinstance(n, int) and not isinstance(n, bool) for n in argnums)
    )
    if isinstance(argnums, bool) or not ok:
        raise ConfigError("argnums", argnums, "an int or a non-empty tuple of ints")
    if isinstance(argnums, tuple) and len(set(argnums)) < len(argnums):
        raise RepeatedArgnumsError(argnums)
    return argnums


class RepeatedArgnumsError(ConfigError, TypeError):
    """`argnums` names one argument twice (`jax.grad` raises a TypeError there too)."""

    def __init__(self, argnums):
        super().__init__("argnums", argnums, "distinct argument indices (each at most once)")


def argnums_mask(args, argnums) -> tuple[bool, ...]:
    """Per flat leaf of `args`: whether it belongs to an argument in `argnums`."""
    nums = (argnums,) if isinstance(argnums, int) else argnums
    for n in nums:
        if not -len(args) <= n < len(args):
            raise ConfigError(
                "argnums",
                argnums,
                f"indices of the {len(args)} positional arguments passed, in "
                f"[{-len(args)}, {len(args)})",
            )
    if len({n % len(args) for n in nums}) < len(nums):  # e.g. (0, -2) with two arguments
        raise RepeatedArgnumsError(argnums)
    nums = {n % len(args) for n in nums}
    mask: list[bool] = []
    for k, a in enumerate(args):
        mask += [k in nums] * len(jax.tree.leaves(a))
    return tuple(mask)


@dataclass(frozen=True)
class Bound:
    """`fun(*args, **kwargs)` split like `jax.grad` splits it: array leaves (arrays, tracers,
    Python numbers) are traced, everything else (strings, callables, kwargs' non-array
    values) is static, part of the cache key and closed over.

    `args` are the traced positional arguments, one list of array leaves per positional
    argument (kwargs' array leaves as one more, never differentiated); `key` identifies the
    static part; `treedefs` rebuild each positional argument from its leaves."""

    fun: Any
    args: tuple
    key: Any
    treedefs: tuple


def _is_array_leaf(x) -> bool:
    """Whether `jax.jit` would trace this leaf (Python numbers included)."""
    array_types = jax.Array | jax.core.Tracer | np.ndarray | np.generic | jax.ShapeDtypeStruct
    return isinstance(x, array_types | int | float | complex)


def bind_static(fun, args: tuple, kwargs: dict, argnums=None) -> Bound | None:
    """None when every leaf is an array and there are no kwargs (nothing to bind)."""
    flat = [jax.tree.flatten(a) for a in args]
    kw_leaves, kw_tree = jax.tree.flatten(kwargs)
    if not kwargs and all(_is_array_leaf(x) for leaves, _ in flat for x in leaves):
        return None
    nums = set()
    if argnums is not None:
        nums = {n % len(args) for n in ((argnums,) if isinstance(argnums, int) else argnums)}
    statics = []
    for i, (leaves, _) in enumerate(flat):
        for k, x in enumerate(leaves):
            if not _is_array_leaf(x):
                if i in nums:
                    raise TypeError(
                        f"Argument {x!r} of type {type(x)} is not a valid JAX type (argument "
                        f"{i} is differentiated: argnums={argnums})"
                    )
                statics.append((i, k, x))
    kw_static = tuple((k, x) for k, x in enumerate(kw_leaves) if not _is_array_leaf(x))
    treedefs = tuple(t for _, t in flat)
    key = (treedefs, tuple(statics), kw_tree, kw_static)
    try:
        hash(key)
    except TypeError:
        raise TypeError(
            "height_compressed: non-array arguments (here "
            f"{[type(x).__name__ for *_, x in statics + list(kw_static)]}) are static: they "
            "must be hashable (they key the cached plan)"
        ) from None
    dyn = tuple([x for x in leaves if _is_array_leaf(x)] for leaves, _ in flat)
    kw_dyn = [x for x in kw_leaves if _is_array_leaf(x)]

    def merge(dyn_leaves, static_leaves: dict, n: int) -> list:
        it = iter(dyn_leaves)
        return [static_leaves[k] if k in static_leaves else next(it) for k in range(n)]

    def bound(*dyn_args):
        full = []
        for i, ((leaves, treedef), d) in enumerate(zip(flat, dyn_args)):
            st = {k: x for j, k, x in statics if j == i}
            full.append(jax.tree.unflatten(treedef, merge(d, st, len(leaves))))
        kw_full = merge(dyn_args[len(flat)], dict(kw_static), len(kw_leaves))
        kw = jax.tree.unflatten(kw_tree, kw_full)
        return fun(*full, **kw)

    return Bound(bound, (*dyn, kw_dyn), key, treedefs)


def program_env(program: Program, leaves) -> dict:
    env = dict(zip(program.invars, leaves))
    env.update(zip(program.constvars, program.consts))
    return env
