"""Random and structured IR graphs for tests and planner benchmarks (no framework needed).

Every generator is deterministic in its `seed`. Byte counts are small integers by default so
that the planner's memory discretisation is exact on them (tests compare with brute force);
`residual_net` builds realistic sizes (a transformer-like stack) for timing.
"""

from __future__ import annotations

import numpy as np

from hbp.graph.ir import Graph, Node


def uniform_chain(n: int, *, nbytes: int = 1, flops: float = 1.0) -> Graph:
    """x -> f1 -> ... -> fn: every op outputs `nbytes`, costs `flops` and saves its input
    (the setting of Revolve and Chen et al.)."""
    nodes = [Node("x", "input", output_bytes=nbytes, is_input=True, requires_grad=False)]
    for i in range(1, n + 1):
        prev = nodes[-1].name
        nodes.append(
            Node(f"f{i}", "op", (prev,), output_bytes=nbytes, flops=flops, saved_inputs=(prev,))
        )
    return Graph(nodes, outputs=[nodes[-1].name], meta={"generator": "uniform_chain"})


def chain(n: int, *, seed: int = 0, max_bytes: int = 6, **kw) -> Graph:
    """A chain of `n` random ops (see `random_dag` for the per-node randomness)."""
    return random_dag(n, seed=seed, skip_prob=0.0, max_bytes=max_bytes, **kw)


def random_dag(
    n: int,
    *,
    seed: int = 0,
    skip_prob: float = 0.35,
    max_skip: int = 4,
    max_bytes: int = 6,
    max_flops: int = 9,
    alias_prob: float = 0.12,
    extra_prob: float = 0.15,
    param_prob: float = 0.3,
    extra_output_prob: float = 0.0,
    input_requires_grad: bool | None = None,
    refinements: bool = False,
    stop_facts: bool = False,
) -> Graph:
    """A random DAG of `n` ops after one graph input, in topological order.

    Op i reads op i-1 (so everything reaches the output) and, with `skip_prob`, one more
    value from up to `max_skip` positions further back (residual-style skips). Per op, at
    random: output bytes in [1, max_bytes], FLOPs in [1, max_flops], what backward saves
    (inputs, output, both or nothing), a view or in-place alias of its first input
    (`alias_prob`), saved extra bytes, parameter gradients, and, with `extra_output_prob`,
    being a graph output besides the last op. With `refinements`, also the optional
    memory facts a capture records on nodes (scratch bytes, gradient sizes, gradient
    pass-through; see `hbp.analysis.liveness`). With `stop_facts`, also what of a saving op a
    recompute pass that stops at it skips (`flops_after_last_save`, `output_after_last_save`:
    NOTE [ Early stop at the last pack ] in `hbp.analysis.simulate`).
    """
    rng = np.random.default_rng(seed)
    if input_requires_grad is None:
        input_requires_grad = bool(rng.random() < 0.3)
    nodes = [
        Node(
            "x",
            "input",
            output_bytes=int(rng.integers(1, max_bytes + 1)),
            is_input=True,
            requires_grad=input_requires_grad,
        )
    ]
    outputs: list[str] = []
    for i in range(1, n + 1):
        prev = nodes[i - 1].name
        inputs = [prev]
        if i >= 2 and rng.random() < skip_prob:
            j = int(rng.integers(max(0, i - 1 - max_skip), i - 1))
            inputs.append(nodes[j].name)
        alias = rng.random() < alias_prob and not nodes[i - 1].is_input
        saves = int(rng.integers(0, 4))  # 0 nothing, 1 inputs, 2 output, 3 both
        saved_inputs = tuple(inputs) if saves in (1, 3) else ()
        if saves == 1 and len(inputs) > 1 and rng.random() < 0.5:
            saved_inputs = (inputs[int(rng.integers(0, len(inputs)))],)
        nodes.append(
            Node(
                f"op{i}",
                "alias" if alias else "op",
                tuple(inputs),
                output_bytes=0 if alias else int(rng.integers(1, max_bytes + 1)),
                flops=float(rng.integers(1, max_flops + 1)),
                saved_inputs=saved_inputs,
                saves_output=saves in (2, 3),
                saved_extra_bytes=int(rng.integers(1, 3)) if rng.random() < extra_prob else 0,
                param_grad_bytes=int(rng.integers(1, 4)) if rng.random() < param_prob else 0,
                alias_of=prev if alias else None,
            )
        )
        if i < n and rng.random() < extra_output_prob:
            outputs.append(nodes[-1].name)
    outputs.append(nodes[-1].name)
    meta: dict = {"generator": "random_dag", "seed": seed}
    if refinements:
        ops = nodes[1:]
        # (the draws in the order of the earlier meta-based version: same graphs per seed)
        for nd in [nd for nd in ops if rng.random() < 0.3]:
            nd.forward_scratch_bytes = int(rng.integers(1, 4))
        for nd in [nd for nd in ops if rng.random() < 0.3]:
            nd.backward_scratch_bytes = int(rng.integers(1, 4))
        for nd in ops:
            if rng.random() < 0.2:
                nd.grad_bytes = int(rng.integers(1, max_bytes + 1))
        for nd in ops:
            if rng.random() < 0.3:
                nd.grad_passthrough = tuple(v for v in nd.inputs if rng.random() < 0.5)
    if stop_facts:  # e.g. a Linear saves its input before it runs: a pass stops before it
        for nd in nodes[1:]:
            if (nd.saved_inputs or nd.saves_output) and rng.random() < 0.8:
                nd.flops_after_last_save = float(rng.integers(1, int(nd.flops) + 1))
                # an op that saves its output has made it before its last save
                nd.output_after_last_save = not nd.saves_output and bool(rng.random() < 0.7)
    return Graph(nodes, outputs=outputs, meta=meta)


def residual_net(
    layers: int,
    *,
    ops_per_layer: int = 60,
    width_bytes: int = 4 * 256 * 1024,
    attn_bytes: int = 4 * 16 * 256 * 256,
    seed: int = 0,
    same_layers: bool = False,
) -> Graph:
    """A transformer-like stack at operator level: per layer two residual branches (an
    attention-like one with one large square tensor, an MLP-like one with a 4x wide part),
    padded with elementwise ops and views to `ops_per_layer` ops. Sizes are bytes of float32
    activations (defaults: batch x tokens x width = 256K floats, 16 heads of 256 x 256).
    About `layers * ops_per_layer + 3` nodes: GPT-2 medium is 24 layers of ~60 ops.

    The padding is drawn at random per layer, so no two layers are alike; `same_layers`
    draws it once, so every layer is the same ops, as in a real model's stack."""
    rng = np.random.default_rng(seed)
    w = width_bytes
    nodes = [Node("x", "input", output_bytes=w, is_input=True, requires_grad=False)]

    def add(name, op, inputs, nbytes, flops, saved=(), out=False, extra=0, param=0, alias=None):
        nodes.append(
            Node(
                name,
                op,
                tuple(inputs),
                output_bytes=0 if alias else int(nbytes),
                flops=float(flops),
                saved_inputs=tuple(saved),
                saves_output=out,
                saved_extra_bytes=int(extra),
                param_grad_bytes=int(param),
                alias_of=alias,
            )
        )
        return name

    h = "x"
    for layer in range(layers):
        if same_layers:
            rng = np.random.default_rng(seed)
        p = f"l{layer}."
        budget_ops = ops_per_layer
        # attention branch
        a = add(p + "ln1", "layer_norm", [h], w, 5 * w, saved=[h], extra=w // 64, param=2048)
        qkv = add(p + "qkv", "linear", [a], 3 * w, 6 * w * 64, saved=[a], param=3 * w // 64)
        q = add(p + "q", "view", [qkv], 0, 0, alias=qkv)
        k = add(p + "k", "view", [qkv], 0, 0, alias=qkv)
        v = add(p + "v", "view", [qkv], 0, 0, alias=qkv)
        s = add(p + "scores", "bmm", [q, k], attn_bytes, 2 * attn_bytes * 16, saved=[q, k])
        s = add(p + "scale", "mul", [s], attn_bytes, attn_bytes)
        s = add(p + "softmax", "softmax", [s], attn_bytes, 5 * attn_bytes, out=True)
        s = add(p + "attn_drop", "dropout", [s], attn_bytes, attn_bytes, extra=attn_bytes // 4)
        o = add(p + "attn_v", "bmm", [s, v], w, 2 * attn_bytes * 16, saved=[s, v])
        o = add(p + "merge", "view", [o], 0, 0, alias=o)
        o = add(p + "proj", "linear", [o], w, 2 * w * 64, saved=[o], param=w // 64)
        budget_ops -= 12
        for i in range(max(0, budget_ops // 2 - 9)):  # elementwise padding
            kind = rng.integers(0, 3)
            if kind == 0:
                o = add(p + f"a_ew{i}", "gelu", [o], w, 8 * w, saved=[o])
            elif kind == 1:
                o = add(p + f"a_ew{i}", "mul", [o], w, w)
            else:
                o = add(p + f"a_ew{i}", "view", [o], 0, 0, alias=o)
        h = add(p + "res1", "add", [h, o], w, w)
        # MLP branch
        a = add(p + "ln2", "layer_norm", [h], w, 5 * w, saved=[h], extra=w // 64, param=2048)
        u = add(p + "fc", "linear", [a], 4 * w, 8 * w * 64, saved=[a], param=4 * w // 64)
        u = add(p + "gelu", "gelu", [u], 4 * w, 32 * w, saved=[u])
        u = add(p + "fc2", "linear", [u], w, 8 * w * 64, saved=[u], param=4 * w // 64)
        for i in range(max(0, ops_per_layer - 12 - max(0, budget_ops // 2 - 9) - 6)):
            kind = rng.integers(0, 3)
            if kind == 0:
                u = add(p + f"m_ew{i}", "dropout", [u], w, w, extra=w // 4)
            elif kind == 1:
                u = add(p + f"m_ew{i}", "mul", [u], w, w)
            else:
                u = add(p + f"m_ew{i}", "view", [u], 0, 0, alias=u)
        h = add(p + "res2", "add", [h, u], w, w)
    h = add("ln_f", "layer_norm", [h], w, 5 * w, saved=[h], extra=w // 64, param=2048)
    h = add("head", "linear", [h], 4 * w, 8 * w * 64, saved=[h], param=4 * w // 64)
    add("loss", "cross_entropy", [h], 4, 4 * w, saved=[h], extra=4 * w)
    return Graph(nodes, outputs=["loss"], meta={"generator": "residual_net", "layers": layers})


def encoder_decoder_net(
    layers: int,
    *,
    width_bytes: int = 4 * 128 * 128,
    attn_bytes: int = 4 * 4 * 128 * 128 * 4,
    vocab_factor: int = 16,
) -> Graph:
    """A T5-like encoder-decoder at operator level, `layers` blocks each side (defaults:
    4 x 128 tokens of width 128 in float32, 4 heads; logits `vocab_factor` times the width).

    What makes it unlike a plain stack: values that live across a whole side and are read by
    every block of it. The encoder's blocks read a position bias made in its first block;
    the decoder's read the encoder output (keys and values of cross-attention), a
    self-attention position bias, a causal mask and a cross-attention bias, all made before
    its first block. Between two decoder blocks five values cross a cut, between two
    encoder blocks two. `meta["blocks"]` lists each block's (first, last) node name in order.
    """
    w, a = width_bytes, attn_bytes
    nodes = [
        Node("ids", "input", output_bytes=w // 32, is_input=True, requires_grad=False),
        Node("labels", "input", output_bytes=w // 32, is_input=True, requires_grad=False),
    ]

    def add(name, op, inputs, nbytes, flops=0.0, saved=(), out=False, extra=0, param=0):
        nodes.append(
            Node(
                name,
                op,
                tuple(inputs),
                output_bytes=int(nbytes),
                flops=float(flops),
                saved_inputs=tuple(saved),
                saves_output=out,
                saved_extra_bytes=int(extra),
                param_grad_bytes=int(param),
                requires_grad=op not in ("bias", "mask"),  # made from the integer inputs
            )
        )
        return name

    def rms_norm(p, h):
        """T5's norm as its ops: h * rsqrt(mean(h^2) + eps) * weight."""
        sq = add(p + "pow", "pow", [h], w, w, saved=[h])
        ms = add(p + "mean", "mean", [sq], w // 128, w)
        r = add(p + "rsqrt", "rsqrt", [ms], w // 128, w // 128, out=True)
        x = add(p + "mul", "mul", [h, r], w, w, saved=[h, r])
        return add(p + "weight", "mul", [x], w, w, saved=[x], param=512)

    def attention(p, h, kv_source, bias, mask=None):
        """Pre-norm attention of h over kv_source (h itself: self-attention) plus a residual."""
        x = rms_norm(p + "ln.", h)
        q = add(p + "q", "linear", [x], w, 2 * w * 128, saved=[x], param=w // 8)
        src = x if kv_source is None else kv_source
        k = add(p + "k", "linear", [src], w, 2 * w * 128, saved=[src], param=w // 8)
        v = add(p + "v", "linear", [src], w, 2 * w * 128, saved=[src], param=w // 8)
        s = add(p + "scores", "bmm", [q, k], a, 2 * a * 32, saved=[q, k])
        s = add(p + "biased", "add", [s, bias] + ([mask] if mask else []), a, a)
        s = add(p + "softmax", "softmax", [s], a, 5 * a, out=True)
        o = add(p + "attn_v", "bmm", [s, v], w, 2 * a * 32, saved=[s, v])
        o = add(p + "o", "linear", [o], w, 2 * w * 128, saved=[o], param=w // 8)
        return add(p + "res", "add", [h, o], w, w)

    def mlp(p, h):
        x = rms_norm(p + "ln.", h)
        u = add(p + "wi", "linear", [x], 4 * w, 8 * w * 128, saved=[x], param=w // 2)
        u = add(p + "relu", "relu", [u], 4 * w, 4 * w, out=True)
        u = add(p + "wo", "linear", [u], w, 8 * w * 128, saved=[u], param=w // 2)
        return add(p + "res", "add", [h, u], w, w)

    blocks = []
    h = add("enc.embed", "embedding", ["ids"], w, w, param=w)
    for i in range(layers):
        first = len(nodes)
        if i == 0:
            enc_bias = add("enc.bias", "bias", ["ids"], a // 4, a // 4)
        h = attention(f"enc{i}.self.", h, None, enc_bias)
        h = mlp(f"enc{i}.mlp.", h)
        blocks.append((nodes[first].name, h))
    enc = rms_norm("enc.final_ln.", h)
    h = add("dec.embed", "embedding", ["labels"], w, w, param=w)
    self_bias = add("dec.self_bias", "bias", ["labels"], a // 4, a // 4)
    causal = add("dec.causal_mask", "mask", ["labels"], a // 64, a // 64)
    cross_bias = add("dec.cross_bias", "bias", ["ids"], a // 4, a // 4)
    for i in range(layers):
        first = len(nodes)
        h = attention(f"dec{i}.self.", h, None, self_bias, causal)
        h = attention(f"dec{i}.cross.", h, enc, cross_bias)
        h = mlp(f"dec{i}.mlp.", h)
        blocks.append((nodes[first].name, h))
    h = rms_norm("dec.final_ln.", h)
    logits = add(
        "lm_head",
        "linear",
        [h],
        vocab_factor * w,
        2 * vocab_factor * w * 128,
        saved=[h],
        param=vocab_factor * w // 4,
    )
    add(
        "loss", "cross_entropy", [logits, "labels"], 4, 4 * vocab_factor * w, extra=vocab_factor * w
    )
    meta = {"generator": "encoder_decoder_net", "layers": layers, "blocks": blocks}
    return Graph(nodes, outputs=["loss"], meta=meta)
