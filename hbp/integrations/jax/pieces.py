"""The "pieces" executor: every segment a separately compiled program."""

from __future__ import annotations

import sys
from functools import partial

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

from hbp.graph.jax_capture import Program
from hbp.integrations.jax.recording import run_compiled
from hbp.integrations.jax.segments import SegmentInfo, fill_zeros, save_policy, segment_fn


@jax.tree_util.register_pytree_node_class
class _Tape:
    """What a forward piece leaves for backward: a vjp (plain) or the inputs (recomputed)."""

    def __init__(self, info: SegmentInfo, vjp=None, inputs=None):
        self.info, self.vjp, self.inputs = info, vjp, inputs

    def tree_flatten(self):
        return (self.vjp, self.inputs), self.info

    @classmethod
    def tree_unflatten(cls, info, children):
        return cls(info, *children)


class PiecesExecutor:
    """The "pieces" executor for one `Program`: each segment a separately compiled program.

    Python references are the memory manager: a value is dropped from `env` after its last
    reader, a tape is dropped once its backward ran, and cotangents and dead activations are
    donated to the piece that consumes them (XLA writes its results into them)."""

    def __init__(self, program: Program):
        self.program = program
        self._fns: dict = {}
        self._add = jax.jit(jnp.add, donate_argnums=(0, 1))

    # jitted pieces, built once per segment ------------------------------------------------
    def _piece(self, kind: str, info: SegmentInfo, extra=()):
        key = (kind, id(info), extra)
        if key not in self._fns:
            self._fns[key] = getattr(self, f"_build_{kind}")(info, *extra)
        return self._fns[key]

    def _build_forward(self, info: SegmentInfo):
        return jax.jit(partial(segment_fn, info))

    def _build_forward_vjp(self, info: SegmentInfo):
        """Forward with vjp, saving exactly the primal values the memory model keeps
        (`SavePolicy`); what else backward needs is recomputed from them in the backward
        piece. The piece returns only residuals that are not its inputs or outputs (XLA would
        copy those), and the vjp is rebuilt from the parts."""
        names, policy = save_policy(self.program, info)
        holder: dict = {}

        def flat(diff_in, nondiff_in):
            seg = jax.checkpoint(lambda d: segment_fn(info, d, nondiff_in, names), policy=policy)
            outs, vjp_fn, aux = jax.vjp(seg, diff_in, has_aux=True)
            leaves, holder["treedef"] = jax.tree.flatten(vjp_fn)
            return [*outs, *aux], leaves

        in_avals = [self._aval(i) for i in info.diff_in], [self._aval(i) for i in info.nondiff_in]
        jaxpr = jax.make_jaxpr(flat)(*in_avals).jaxpr
        n_out = len(info.live_out)
        outvars, resvars = jaxpr.outvars[:n_out], jaxpr.outvars[n_out:]
        sources, computed = [], []  # per residual: ("in", k) | ("out", k) | ("new", k)
        for r in resvars:
            if not isinstance(r, Literal) and r in jaxpr.invars:
                sources.append(("in", jaxpr.invars.index(r)))
            elif any(r is o for o in outvars):
                sources.append(("out", next(k for k, o in enumerate(outvars) if r is o)))
            else:
                sources.append(("new", len(computed)))
                computed.append(len(sources) - 1)
        treedef = holder["treedef"]

        @jax.jit
        def forward_vjp(diff_in, nondiff_in):
            outs, leaves = flat(diff_in, nondiff_in)
            return outs, [leaves[k] for k in computed]

        def run(diff_in, nondiff_in):
            outs, new = self._call(f"forward+save {info.label}", forward_vjp, diff_in, nondiff_in)
            flat_in = [*diff_in, *nondiff_in]
            leaves = [
                flat_in[k] if src == "in" else outs[k] if src == "out" else new[k]
                for src, k in sources
            ]
            n = len(info.diff_out)
            return outs[:n], outs[n:], jax.tree.unflatten(treedef, leaves)

        return run

    def _build_apply_vjp(self, info: SegmentInfo, has_acc: tuple[bool, ...]):
        program = self.program

        @partial(jax.jit, donate_argnums=(1, 2))  # cotangents and accumulators die here
        def apply_vjp(vjp_fn, cts, accs):
            in_cts = vjp_fn(fill_zeros(cts, info.diff_out, program))[0]
            return _add_accumulated(in_cts, accs, has_acc)

        return apply_vjp

    def _build_fused(
        self,
        info: SegmentInfo,
        keep: tuple[int, ...],
        dead: tuple[bool, ...],
        has_acc: tuple[bool, ...],
    ):
        """Forward (or recompute) and backward of a childless segment in one program;
        returns the outputs listed in `keep` and the cotangents of the diff inputs (added to
        their accumulators, see `_take_accumulators`). Diff inputs flagged `dead` (nothing
        else refers to them), the cotangents and the accumulators are donated, so XLA can
        write the results into them."""
        program = self.program

        @partial(jax.jit, donate_argnums=(0, 3, 4))
        def fused(dead_in, live_in, nondiff_in, cts, accs):
            dead_it, live_it = iter(dead_in), iter(live_in)
            diff_in = [next(dead_it) if d else next(live_it) for d in dead]
            outs, vjp_fn, aux = jax.vjp(
                lambda d: segment_fn(info, d, nondiff_in), diff_in, has_aux=True
            )
            values = dict(zip(info.diff_out, outs))
            values.update(zip(info.nondiff_out, aux))
            in_cts = vjp_fn(fill_zeros(cts, info.diff_out, program))[0]
            return [values[o] for o in keep], _add_accumulated(in_cts, accs, has_acc)

        return fused

    def _run_fused(self, name, info, keep, diff_in: list, nondiff_in: list, cts: list, ct: dict):
        # An array only `diff_in` refers to (list entry + getrefcount's argument) is dead
        # after this piece: donate it.
        dead = tuple(sys.getrefcount(diff_in[k]) <= 2 for k in range(len(diff_in)))
        dead_in = [v for v, d in zip(diff_in, dead) if d]
        live_in = [v for v, d in zip(diff_in, dead) if not d]
        diff_in.clear()
        has_acc, accs = _take_accumulators(ct, info.diff_in)
        fused = self._piece("fused", info, (keep, dead, has_acc))
        return self._call(name, fused, dead_in, live_in, nondiff_in, cts, accs)

    def _aval(self, i: int):
        a = self.program.avals[i]
        return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))

    def _call(self, name: str, fn, *args):
        return run_compiled(name, fn, *args)

    # passes -------------------------------------------------------------------------------
    def forward(self, infos: list[SegmentInfo], env: dict, keep: set[int]) -> list[_Tape]:
        """Run `infos` forward, leaving in `env` the values in `keep` or read by a later
        segment; returns one tape per segment for `backward`."""
        last_use = {i: s for s, info in enumerate(infos) for i in info.live_in}
        tapes = []
        for s, info in enumerate(infos):
            diff_in = [env[i] for i in info.diff_in]
            nondiff_in = [env[i] for i in info.nondiff_in]
            needs_backward = bool(info.diff_in and info.diff_out)
            if info.recompute or not needs_backward:
                name = f"forward {info.label}"
                douts, nouts = self._call(name, self._piece("forward", info), diff_in, nondiff_in)
                if needs_backward:
                    tapes.append(_Tape(info, inputs=(diff_in, nondiff_in)))
            else:
                douts, nouts, vjp_fn = self._piece("forward_vjp", info)(diff_in, nondiff_in)
                tapes.append(_Tape(info, vjp=vjp_fn))
                del vjp_fn
            del diff_in, nondiff_in
            for o, v in zip(info.diff_out + info.nondiff_out, [*douts, *nouts]):
                if o in keep or last_use.get(o, -1) > s:
                    env[o] = v
            del douts, nouts
            for i in info.live_in:
                if last_use[i] == s and i not in keep:
                    env.pop(i, None)
        return tapes

    def backward(self, tapes: list[_Tape], ct: dict) -> None:
        """Backpropagate through `tapes` in reverse, consuming them; `ct` maps value ids to
        cotangents: those of the segments' outputs are consumed, those of their inputs
        accumulated."""
        while tapes:
            tape = tapes.pop()
            info = tape.info
            cts = [ct.pop(o, None) for o in info.diff_out]
            if not info.diff_in or all(c is None for c in cts):
                continue
            if tape.vjp is not None:
                name = f"backward {info.label}"
                has_acc, accs = _take_accumulators(ct, info.diff_in)
                apply_vjp = self._piece("apply_vjp", info, (has_acc,))
                in_cts = self._call(name, apply_vjp, tape.vjp, cts, accs)
                del accs
            elif not info.children:
                diff_in, nondiff_in = tape.inputs
                del tape
                name = f"recompute+backward {info.label}"
                _, in_cts = self._run_fused(name, info, (), diff_in, nondiff_in, cts, ct)
                del diff_in, nondiff_in, cts
                self._accumulate(ct, info.diff_in, in_cts)
                del in_cts  # else this frame keeps them alive through the next recursion
                continue
            else:
                diff_in, nondiff_in = tape.inputs
                env = dict(zip(info.diff_in, diff_in))
                env.update(zip(info.nondiff_in, nondiff_in))
                ct.update((o, c) for o, c in zip(info.diff_out, cts) if c is not None)
                del tape, cts, diff_in, nondiff_in
                self.run_with_backward(info.children, env, ct, keep=set())
                continue
            del tape, cts
            self._accumulate(ct, info.diff_in, in_cts)
            del in_cts

    def run_with_backward(
        self, infos: list[SegmentInfo], env: dict, ct: dict, keep: set[int]
    ) -> None:
        """Forward through `infos`, then backward: the last segment runs forward and backward
        in one piece. Values in `keep` are left in `env`; `ct` as in `backward`."""
        *head, last = infos
        tapes = self.forward(head, env, keep | set(last.live_in))
        if last.children:
            sub_env = {i: env[i] for i in last.live_in}
            for i in last.live_in:
                if i not in keep:
                    env.pop(i, None)
            self.run_with_backward(last.children, sub_env, ct, keep)
            env.update((i, sub_env[i]) for i in keep if i in sub_env)
            del sub_env
        else:
            cts = [ct.pop(o, None) for o in last.diff_out]
            out_keep = tuple(o for o in last.live_out if o in keep)
            diff_in = [env[i] for i in last.diff_in]
            nondiff_in = [env[i] for i in last.nondiff_in]
            for i in last.live_in:
                if i not in keep:
                    env.pop(i, None)
            name = f"forward+backward {last.label}"
            outs, in_cts = self._run_fused(name, last, out_keep, diff_in, nondiff_in, cts, ct)
            del diff_in, nondiff_in, cts
            env.update(zip(out_keep, outs))
            self._accumulate(ct, last.diff_in, in_cts)
            del outs, in_cts  # else they stay alive while `backward` below recurses
        self.backward(tapes, ct)

    def _accumulate(self, ct: dict, ids, values) -> None:
        for i, v in zip(ids, values):
            if i in ct:  # (a value read twice by one segment)
                ct[i] = self._call("accumulate", self._add, ct[i], v)
            else:
                ct[i] = v


# NOTE [ Accumulating cotangents inside the piece ]
# A value read by several segments (a weight used twice, or a stacked scan weight that every
# unrolled layer slices) gets a cotangent from each of their backward pieces. The slice's
# cotangent is a full-size array (zeros but the slice): made by the piece and added to the
# running sum afterwards, two full-size arrays are live at once, one more than the memory
# model (a parameter's gradient, held once) counts. So a backward piece takes the running
# sums of its inputs' cotangents as donated arguments and returns `running + its own`: XLA
# fuses the padding into the add and writes the result into the donated buffer.


def _take_accumulators(ct: dict, ids) -> tuple[tuple[bool, ...], list]:
    """Pop the running cotangents of `ids` out of `ct` (for a piece to add into):
    (which ids had one, the arrays)."""
    has_acc = tuple(i in ct for i in ids)
    return has_acc, [ct.pop(i) for i, h in zip(ids, has_acc) if h]


def _add_accumulated(in_cts, accs, has_acc: tuple[bool, ...]) -> list:
    """Inside a piece: each input cotangent plus its running sum, where there is one."""
    it = iter(accs)
    return [c + next(it) if h else c for c, h in zip(in_cts, has_acc)]
