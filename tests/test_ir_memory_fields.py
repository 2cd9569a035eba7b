"""Memory facts are typed `Node` fields: they survive a JSON round trip, graphs written with
the legacy per-node `graph.meta` keys load onto the same fields, and the simulator reads them."""

from hbp.analysis.liveness import GraphInfo
from hbp.analysis.simulate import simulate
from hbp.graph.ir import Graph, Node


def refined_chain(legacy: bool) -> Graph:
    """x -> a (10) -> b (20) -> c (30); b holds 5 bytes of forward scratch, c 7 bytes of
    backward scratch, a's gradient is 3 bytes, c passes its gradient through to b."""
    nodes = [
        Node("x", "input", (), 4, requires_grad=False, is_input=True),
        Node("a", "op", ("x",), 10, saved_inputs=("x",)),
        Node("b", "op", ("a",), 20, saved_inputs=("a",)),
        Node("c", "op", ("b",), 30, saved_inputs=("b",)),
    ]
    if legacy:
        meta = {
            "framework": "torch",
            "forward_transient_bytes": {"b": 5},
            "backward_transient_bytes": {"c": 7},
            "grad_bytes": {"a": 3},
            "grad_passthrough": {"c": ["b"]},
            "flops_after_last_save": {"a": 2.0},
            "output_after_last_save": ["a"],
        }
        return Graph(nodes, ["c"], meta)
    a, b, c = nodes[1:]
    b.forward_scratch_bytes, c.backward_scratch_bytes = 5, 7
    a.grad_bytes, c.grad_passthrough = 3, ("b",)
    a.flops_after_last_save, a.output_after_last_save = 2.0, True
    return Graph(nodes, ["c"], {"framework": "torch"})


def test_fields_round_trip_through_json():
    g = refined_chain(legacy=False)
    back = Graph.from_json(g.to_json())
    assert back.nodes == g.nodes
    assert back.meta == {"framework": "torch"}
    assert back.node("c").grad_passthrough == ("b",)


def test_legacy_meta_keys_load_onto_the_fields():
    legacy = refined_chain(legacy=True)
    loaded = Graph.from_dict(legacy.to_dict())
    assert loaded.nodes == refined_chain(legacy=False).nodes
    assert loaded.meta == {"framework": "torch"}  # provenance only


def test_simulator_reads_the_fields_and_legacy_graphs_alike():
    new, old = refined_chain(legacy=False), refined_chain(legacy=True)
    info = GraphInfo.of(new)
    assert info.forward_scratch_bytes.tolist() == [0, 0, 5, 0]
    assert info.backward_scratch_bytes.tolist() == [0, 0, 0, 7]
    assert info.grad_bytes.tolist() == [0, 3, 20, 30]
    assert info.passthrough[3] == (2,)
    assert simulate(new).timeline == simulate(old).timeline
    # forward: a, b, c alive (60); seed grad c (90); backward:c passes it to b, +7 scratch
    assert simulate(new).peak_bytes == 97
