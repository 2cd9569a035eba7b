"""The memory simulator on hand-built graphs whose peaks are worked out by hand below.

Conventions: `x` is a graph input (costs nothing, no gradient unless stated); every op saves
its input unless stated; sizes in bytes. Each expected number is derived in a comment."""

import pytest

from hbp.analysis import naive_peak, simulate
from hbp.analysis.liveness import GraphInfo
from hbp.graph.ir import Graph, Node
from hbp.planner.plan import Plan, Segment
from hbp.planner.tree import validate_plan


def x_input(nbytes=100, requires_grad=False):
    return Node("x", "input", output_bytes=nbytes, is_input=True, requires_grad=requires_grad)


def chain4():
    """x -> a(10) -> b(20) -> c(30) -> d(40, output); FLOPs 1, 2, 3, 4."""
    nodes = [x_input()]
    for k, (name, size) in enumerate([("a", 10), ("b", 20), ("c", 30), ("d", 40)]):
        prev = nodes[-1].name
        nodes.append(Node(name, "op", (prev,), size, flops=k + 1, saved_inputs=(prev,)))
    return Graph(nodes, outputs=["d"])


def test_chain_naive():
    # forward keeps everything: a 10, b 30, c 60, d 100; backward seeds grad d: 140;
    # backward of d allocates grad c: 170 (the peak); then c and grad d go.
    sim = simulate(chain4())
    assert sim.peak_bytes == 170
    assert (sim.peak_phase, sim.peak_at) == ("backward", "d")
    assert sim.timeline == [
        ("forward:a", 10),
        ("forward:b", 30),
        ("forward:c", 60),
        ("forward:d", 100),
        ("backward", 140),
        ("backward:d", 170),
        ("backward:c", 120),
        ("backward:b", 80),
        ("backward:a", 50),
    ]
    assert sim.recompute_flops == 0
    assert sim.total_flops == 10 + 2 * 10  # forward + default backward (2x)
    assert naive_peak(chain4()) == 170


def test_chain_recompute_segment():
    # [x a b] recomputed: a is freed after b (nothing saved); c saves b: forward c 50, d 90.
    # backward: seed 130, d: +grad c 160 (peak), c: +grad b 110 -> 60; recompute a: 70,
    # b: 90 (b itself unused in the segment: freed, a held by b) -> 70; b: +grad a 80; a: 50.
    plan = [Segment(0, 3, True), Segment(3, 5)]
    sim = simulate(chain4(), plan)
    assert sim.peak_bytes == 160
    assert sim.recompute_flops == 1 + 2
    assert sim.timeline[:4] == [("forward:a", 10), ("forward:b", 30), ("forward:c", 50),
                                ("forward:d", 90)]  # fmt: skip
    assert sim.timeline[6:] == [
        ("backward:c", 110),
        ("recompute:a", 70),
        ("recompute:b", 90),
        ("backward:b", 80),
        ("backward:a", 50),
    ]


def test_segment_input_saved_by_later_plain_node_stays():
    # [x a] recomputed but b (plain) saves a: nothing is gained, the naive peak remains.
    sim = simulate(chain4(), [Segment(0, 2, True), Segment(2, 5)])
    assert sim.peak_bytes == 170
    assert sim.recompute_flops == 1


def diamond():
    """x -> a(10) -> b(20, saves a); c(30) reads a and b (saves both); d(5, output) saves c."""
    return Graph(
        [
            x_input(),
            Node("a", "op", ("x",), 10, flops=1, saved_inputs=("x",)),
            Node("b", "op", ("a",), 20, flops=2, saved_inputs=("a",)),
            Node("c", "op", ("a", "b"), 30, flops=3, saved_inputs=("a", "b")),
            Node("d", "op", ("c",), 5, flops=4, saved_inputs=("c",)),
        ],
        outputs=["d"],
    )


def test_diamond_with_skip():
    # naive: forward 10, 30, 60, 65; seed 70; d: +grad c 100 (peak).
    assert naive_peak(diamond()) == 100
    # [b c] recomputed: a is its input (held), b freed after c: forward 10, 30, 60 -> 40, d 45.
    # backward: seed 50, d: +grad c 80 -> 45; recompute b 65, c 95 (peak) -> 65;
    # c: +grad a +grad b 95; b: grad a exists: the one b computes (10) is live until it is
    # accumulated (in place) 55.
    sim = simulate(diamond(), [Segment(0, 2), Segment(2, 4, True), Segment(4, 5)])
    assert sim.peak_bytes == 95
    assert sim.recompute_flops == 2 + 3
    assert ("recompute:c", 95) in sim.timeline
    assert ("backward:c", 95) in sim.timeline
    assert ("backward:b", 55) in sim.timeline


def test_view_keeps_its_base_alive():
    # v = view(a) (no bytes) is saved by b: a's 10 bytes live until b's backward.
    # forward a 10, v 10, b 30; seed 50; b: grad v (0 bytes) 50 -> a freed, grad b freed: 20;
    # v: +grad a 30; a: 30.
    g = Graph(
        [
            x_input(),
            Node("a", "op", ("x",), 10, saved_inputs=("x",)),
            Node("v", "view", ("a",), 0, alias_of="a"),
            Node("b", "op", ("v",), 20, saved_inputs=("v",)),
        ],
        outputs=["b"],
    )
    sim = simulate(g)
    assert sim.peak_bytes == 50
    assert sim.timeline == [
        ("forward:a", 10),
        ("forward:v", 10),
        ("forward:b", 30),
        ("backward", 50),
        ("backward:b", 50),
        ("backward:v", 30),
        ("backward:a", 30),
    ]


def test_in_place_result_shares_storage():
    # r = relu_(a) saves its output, which is a's storage: counted once.
    # forward a 10, r 10, b 30; seed 50; b: 50; r: +grad a 40 -> a freed 30; a: 30.
    g = Graph(
        [
            x_input(),
            Node("a", "op", ("x",), 10, saved_inputs=("x",)),
            Node("r", "relu_", ("a",), 0, alias_of="a", saves_output=True),
            Node("b", "op", ("r",), 20),
        ],
        outputs=["b"],
    )
    sim = simulate(g)
    assert sim.peak_bytes == 50
    assert ("backward:r", 40) in sim.timeline


def test_parameter_and_input_gradients_are_kept():
    # a has 7 bytes of parameter gradients, b 3; x requires grad (100 bytes).
    # forward a 10, b 30; seed 50; b: +grad a 10 +param 3 = 63 -> 33; a: +grad x 100
    # +param 7 = 140 (peak) -> grad a freed: 130.
    g = Graph(
        [
            x_input(requires_grad=True),
            Node("a", "op", ("x",), 10, saved_inputs=("x",), param_grad_bytes=7),
            Node("b", "op", ("a",), 20, saved_inputs=("a",), param_grad_bytes=3),
        ],
        outputs=["b"],
    )
    sim = simulate(g)
    assert sim.timeline[-2:] == [("backward:b", 63), ("backward:a", 140)]
    assert sim.peak_bytes == 140


def test_saved_extra_bytes_and_no_grad_nodes():
    # a saves 4 extra bytes (e.g. a dropout mask) only when it has a backward; m does not
    # require grad (a mask computed from x): it saves nothing, has no gradient.
    g = Graph(
        [
            x_input(),
            Node("m", "op", ("x",), 6, requires_grad=False, saved_inputs=("x",)),
            Node("a", "op", ("x", "m"), 10, saved_inputs=("m",), saved_extra_bytes=4),
            Node("b", "op", ("a",), 20, saved_inputs=("a",)),
        ],
        outputs=["b"],
    )
    # forward m 6; a 6+10+4 = 20 (m held by a); b 40; seed 60; b: +grad a 70 -> a and
    # grad b go: 40; a: no gradient for x or m: 40.
    sim = simulate(g)
    assert sim.peak_bytes == 70
    assert sim.timeline[1] == ("forward:a", 20)
    assert sim.timeline[-1] == ("backward:a", 40)


def chain6():
    """x -> n1 .. n6 (sizes 10 .. 60, FLOPs 1 .. 6, output n6)."""
    nodes = [x_input()]
    for i in range(1, 7):
        prev = nodes[-1].name
        nodes.append(Node(f"n{i}", "op", (prev,), 10 * i, flops=i, saved_inputs=(prev,)))
    return Graph(nodes, outputs=["n6"])


def test_nested_plan_timeline():
    # [x n1 n2 n3] recomputed with children [[x n1] recomputed, [n2 n3] plain], then plain.
    # forward: n1 10, n2 30 -> 20, n3 50 -> 30, n4 70, n5 120, n6 180; seed 240;
    # n6: +grad n5 290 (peak) -> 180; n5: 220 -> 130; n4: 160 -> 90 (n6 + grad n3).
    # recompute of the outer segment: enter the inner one (holds x), n1 100, n2 120, n3 150
    # (unused: freed) -> 120; n3: +grad n2 140 -> 90; n2: +grad n1 100 -> 70;
    # recompute of the inner one: n1 80 -> 70; n1: 70.
    plan = [
        Segment(0, 4, True, [Segment(0, 2, True), Segment(2, 4)]),
        Segment(4, 7),
    ]
    sim = simulate(chain6(), plan)
    assert sim.peak_bytes == 290
    assert sim.recompute_flops == (1 + 2 + 3) + 1
    assert sim.timeline[10:] == [
        ("recompute:n1", 100),
        ("recompute:n2", 120),
        ("recompute:n3", 150),
        ("backward:n3", 140),
        ("backward:n2", 100),
        ("recompute:n1", 80),
        ("backward:n1", 70),
    ]
    validate_plan(chain6(), Plan(plan, budget_bytes=290, predicted_peak_bytes=290))


def test_recompute_pass_stops_after_last_save_event():
    # b saves nothing (like an add): the recompute of [x a b] stops after a, as
    # torch.utils.checkpoint's non-reentrant early stop does; b is not recomputed. And b's
    # backward unpacks nothing, so it runs before the recompute (which the first unpack, a's,
    # starts: NOTE [ Recompute at the first unpack ]).
    g = Graph(
        [
            x_input(),
            Node("a", "op", ("x",), 10, flops=1, saved_inputs=("x",)),
            Node("b", "add", ("a",), 20, flops=2),
            Node("c", "op", ("b",), 30, flops=3, saved_inputs=("b",)),
        ],
        outputs=["c"],
    )
    # forward a 10, b 30 -> 20, c 50; seed 80; c: +grad b 100 (peak) -> 50; b: +grad a 60,
    # -grad b -> 40; recompute a: 50 (b will not run); a: 40.
    sim = simulate(g, [Segment(0, 3, True), Segment(3, 4)])
    assert sim.peak_bytes == 100
    assert sim.recompute_flops == 1
    assert sim.timeline[-3:] == [("backward:b", 60), ("recompute:a", 50), ("backward:a", 40)]


def test_tail_after_the_last_save_event_has_its_backward_before_the_recompute():
    # v (a view, like unbind) saves nothing: torch recomputes [a b v] at the first unpack,
    # b's, so v's backward runs first (NOTE [ Recompute at the first unpack ]); nested, the
    # outer pass (it only enters [a b]) and the inner one both run at b, outermost first.
    g = Graph(
        [
            x_input(),
            Node("a", "op", ("x",), 10, flops=1, saved_inputs=("x",)),
            Node("b", "op", ("a",), 20, flops=2, saves_output=True),
            Node("v", "view", ("b",), 0, alias_of="b"),
            Node("c", "op", ("v",), 30, flops=3, saved_inputs=("v",)),
        ],
        outputs=["c"],
    )
    # seed 80 (c 30, b held by c 20, grad c 30); c: 80 (grad v is 0 bytes) -> 30;
    # v: +grad b 50; recompute a 60, b 80; b: 80; a: 40.
    sim = simulate(g, [Segment(0, 4, True), Segment(4, 5)], check=True)
    assert sim.timeline[-6:] == [
        ("backward:c", 80),
        ("backward:v", 50),
        ("recompute:a", 60),
        ("recompute:b", 80),
        ("backward:b", 80),
        ("backward:a", 40),
    ]
    inner = Segment(0, 3, True, [Segment(0, 2, True), Segment(2, 3)])
    sim = simulate(g, [Segment(0, 4, True, [inner, Segment(3, 4)]), Segment(4, 5)], check=True)
    assert [event for event, _ in sim.timeline[-6:]] == [
        "backward:v",
        "recompute:a",
        "recompute:b",
        "backward:b",
        "recompute:a",
        "backward:a",
    ]
    assert sim.recompute_flops == 1 + 2 + 1


def test_a_pass_stopping_at_a_node_that_saves_only_inputs_does_not_run_it():
    # a is a Linear (saves its input x, packed before its matmul runs): the recompute of
    # [a b] stops in that pack, so a never runs again (NOTE [ Early stop at the last pack ]);
    # half of its FLOPs running before the save (a composite op) are counted, with its event.
    def graph(after):
        a = Node("a", "op", ("x",), 10, flops=4, saved_inputs=("x",))
        a.flops_after_last_save, a.output_after_last_save = after, after == 4
        b = Node("b", "add", ("a",), 20, flops=2)
        c = Node("c", "op", ("b",), 30, flops=3, saved_inputs=("b",))
        return Graph([x_input(requires_grad=True), a, b, c], outputs=["c"])

    plan = [Segment(0, 3, True), Segment(3, 4)]
    sim = simulate(graph(4.0), plan, check=True)
    assert sim.recompute_flops == 0
    assert not any(event.startswith("recompute") for event, _ in sim.timeline)
    sim = simulate(graph(2.0), plan, check=True)
    assert sim.recompute_flops == 2
    assert [event for event, _ in sim.timeline if event.startswith("recompute")] == ["recompute:a"]


def test_capture_refinements_in_meta():
    # forward scratch of b (5), backward scratch of c (7), a's gradient is 3 bytes, and c
    # passes its output gradient through to b (no new allocation).
    g = chain4()
    g.meta.update(
        forward_transient_bytes={"b": 5},
        backward_transient_bytes={"c": 7},
        grad_bytes={"a": 3},
        grad_passthrough={"c": ("b",)},
    )
    # forward a 10, b 30 + 5, c 60, d 100; seed 140; d: +grad c 170 -> 100;
    # c: grad b is grad c itself (30, shared), +7 scratch: 107 -> b freed, grad c kept: 80;
    # b: +grad a (3) 83 -> a freed, the shared gradient freed: 43.
    sim = simulate(g)
    assert sim.timeline[1] == ("forward:b", 35)
    assert sim.timeline[6:] == [("backward:c", 107), ("backward:b", 83), ("backward:a", 43)]


def test_plan_object_and_bare_segments_agree():
    plan = Plan([Segment(0, 3, True), Segment(3, 5)])
    assert simulate(chain4(), plan).timeline == simulate(chain4(), plan.segments).timeline
    assert simulate(chain4(), [Segment(0, 5)]).timeline == simulate(chain4()).timeline


@pytest.mark.parametrize(
    "segments, message",
    [
        ([Segment(0, 2), Segment(3, 5)], "must start at 2"),
        ([Segment(0, 4)], "segments end at 4, expected 5"),
        ([Segment(0, 5, False, [Segment(0, 5)])], "has children but is not recomputed"),
        ([Segment(0, 5, True, [Segment(0, 2)])], "expected 5"),
    ],
)
def test_bad_tilings_are_rejected(segments, message):
    with pytest.raises(ValueError, match=message):
        simulate(chain4(), segments)


def test_bad_graphs_are_rejected():
    with pytest.raises(ValueError, match="not an earlier node"):
        GraphInfo.of(Graph([Node("a", "op", ("b",)), Node("b", "op")]))
    with pytest.raises(ValueError, match="duplicate node name"):
        GraphInfo.of(Graph([Node("a", "op"), Node("a", "op")]))
    with pytest.raises(ValueError, match="alias_of"):
        GraphInfo.of(Graph([x_input(), Node("v", "view", (), alias_of="x")]))
    with pytest.raises(ValueError, match="saves 'y'"):
        GraphInfo.of(Graph([x_input(), Node("a", "op", ("x",), saved_inputs=("y",))]))


def test_validate_plan_reports_budget_and_graph_mismatch():
    plan = Plan([Segment(0, 3, True), Segment(3, 5)], budget_bytes=159)
    with pytest.raises(ValueError, match="exceeds the budget"):
        validate_plan(chain4(), plan)
    plan = Plan([Segment(0, 3, True), Segment(3, 5)], budget_bytes=160, predicted_peak_bytes=1)
    with pytest.raises(ValueError, match="another graph"):
        validate_plan(chain4(), plan)
    with pytest.raises(ValueError, match="only graph inputs"):
        validate_plan(chain4(), Plan([Segment(0, 1, True), Segment(1, 5)]))


def shared_grad_graph():
    """x -> a(1000), b(1000); t = f(a) (1000, output); s = a + b (1000, output), whose
    gradient passes through to a and b (autograd's AddBackward returns the same tensor)."""
    nodes = [
        x_input(),
        Node("a", "op", ("x",), 1000),
        Node("b", "op", ("x",), 1000),
        Node("t", "op", ("a",), 1000),
        Node("s", "add", ("a", "b"), 1000),
    ]
    meta = {"grad_passthrough": {"s": ("a", "b")}}
    return Graph(nodes, outputs=["s", "t"], meta=meta)


def test_accumulating_into_a_shared_gradient_allocates():
    # Regression (synthetic_dag measured 256 KiB over the prediction): forward ends with the
    # outputs s, t (2000); backward seeds grad s, grad t: 4000. backward:s gives a and b
    # grad s itself (shared, 4000). backward:t then accumulates into a's gradient, which is
    # also b's: autograd adds out of place (new 1000: 5000, the peak) and b keeps the old one.
    sim = simulate(shared_grad_graph())
    events = dict(sim.timeline)
    assert (events["backward"], events["backward:s"], events["backward:t"]) == (4000, 4000, 5000)
    assert (sim.peak_bytes, sim.peak_at) == (5000, "t")


def test_dp_cost_model_counts_shared_gradient_accumulation():
    from hbp.planner.dp import CostModel

    graph = shared_grad_graph()
    info = GraphInfo.of(graph)
    model = CostModel(info, [0, info.n])
    t = info.names.index("t")
    # pos_bwd: gradients and outputs at backward:t: grad t, the shared grad s, a's new
    # gradient and the outputs s, t: the simulator's 5000 at that event (nothing is saved).
    assert int(model.pos_bwd[t]) == dict(simulate(graph).timeline)["backward:t"] == 5000


def test_saved_extras_of_a_node_run_without_saving_are_scratch_of_its_event():
    # a saves 4 extra bytes (a dropout mask). Recomputed, a runs with saving off: the op still
    # makes the mask and the pack hook drops it, so it is live during a's event only.
    g = Graph(
        [
            x_input(),
            Node("a", "op", ("x",), 10, flops=1, saved_inputs=("x",), saved_extra_bytes=4),
            Node("b", "op", ("a",), 20, flops=1, saved_inputs=("a",)),
        ],
        outputs=["b"],
    )
    # plain: forward a 10 + 4 = 14. Recomputed [x a]: forward a 10 + 4 scratch = 14 -> 10;
    # b 30 (a held by b); seed 50; b: +grad a 60 -> 30 (a, grad b go); recompute a:
    # 10 + 4 (saved this time) = 44, then a itself goes (nothing in the pass reads it, a's
    # backward does not need it) -> 34; a: 34.
    sim = simulate(g, [Segment(0, 2, True), Segment(2, 3)])
    assert sim.timeline[:2] == [("forward:a", 14), ("forward:b", 30)]
    assert sim.timeline[-2:] == [("recompute:a", 44), ("backward:a", 34)]
    assert sim.peak_bytes == 60


def test_checkpoints_of_random_segments_keep_generator_states():
    # NOTE [ Generator states of checkpoints ], on test_nested_plan_timeline's plan with n1
    # drawing random numbers and a state of 1 byte: both checkpoints copy the state in the
    # forward (n1's event: 10 + 2) and keep it until n1's backward (the first save event of
    # both); the outer pass holds its fork (+1) and a new copy for the inner checkpoint it
    # runs (+1), both gone when it ends; the inner pass holds its fork (+1).
    graph = chain6()
    graph.nodes[1].draws_random = True
    graph.rng_state_bytes = 1
    plan = [
        Segment(0, 4, True, [Segment(0, 2, True), Segment(2, 4)]),
        Segment(4, 7),
    ]
    sim = simulate(graph, plan)
    assert sim.peak_bytes == 290 + 2
    assert sim.timeline[0] == ("forward:n1", 12)
    assert sim.timeline[10:] == [
        ("recompute:n1", 100 + 4),
        ("recompute:n2", 120 + 4),
        ("recompute:n3", 150 + 4),
        ("backward:n3", 140 + 2),
        ("backward:n2", 100 + 2),
        ("recompute:n1", 80 + 3),
        ("backward:n1", 70 + 2),
    ]
    # a state costs nothing where it is not in the measured memory (CUDA), nor without
    # random nodes
    graph.rng_state_bytes = 0
    assert simulate(graph, plan).timeline == simulate(chain6(), plan).timeline
