"""Document chains (flowlift.chains): model steps joined to the input that shares the
most whole KV blocks of their prompt prefix; the compiler's and the growing plan's."""

from __future__ import annotations

from flowlift.chains import chain_parent, document_chains, members
from flowlift.compiler import CompileOptions, compile_graph
from flowlift.graph import Graph, LLMNode, MessageTemplate, Ref, Text
from flowlift.incremental import GrowingPlan


def block(model: str) -> int:
    return 4


def test_a_step_joins_the_input_sharing_the_longest_whole_block():
    me = ("m", [1, 2, 3, 4, 5, 6, 9])
    inputs = [("a", ("m", [1, 2, 3, 4, 8])), ("b", ("m", [1, 2, 3, 4, 5, 6, 7])),
              ("c", ("other", [1, 2, 3, 4, 5, 6, 9]))]
    assert chain_parent(me, inputs, block) == "b"
    assert chain_parent(me, [("a", ("m", [1, 2, 3, 7]))], block) is None  # < one block
    assert chain_parent(me, inputs[2:], block) is None  # another model's cache


def test_a_step_reading_every_document_joins_one_chain_only():
    doc = {d: ("m", [d] * 8) for d in (1, 2)}
    prefixes = {"x1": doc[1], "y1": doc[1], "x2": doc[2], "y2": doc[2],
                "report": ("m", [1] * 8 + [0])}
    deps = {"y1": frozenset({"x1"}), "y2": frozenset({"x2"}),
            "report": frozenset({"y1", "y2"})}
    chain = document_chains(["x1", "x2", "y1", "y2", "report"], deps, prefixes, block)
    assert chain == {"x1": "x1", "x2": "x2", "y1": "x1", "y2": "x2", "report": "x1"}
    assert members(chain) == {"x1": ["x1", "y1", "report"], "x2": ["x2", "y2"]}


def _doc_graph(docs: int) -> Graph:
    nodes: list[LLMNode] = []
    for d in range(docs):
        text = f"Document {d}: " + " ".join(f"word{d}x{i}" for i in range(200))
        first = LLMNode(id=f"extract{d}", messages=(MessageTemplate(
            role="user", content=(Text(text=text + "\nExtract the facts."),)),))
        second = LLMNode(id=f"classify{d}", messages=(MessageTemplate(
            role="user", content=(Text(text=text + "\nFacts: "), Ref(ref=first.id),
                                  Text(text="\nClassify."))),))
        nodes += [first, second]
    return Graph(name="docs", nodes=tuple(nodes))


def test_the_compiler_and_the_growing_plan_chain_each_documents_steps():
    graph = _doc_graph(3)
    plan = compile_graph(graph, CompileOptions())
    assert plan.chain == {f"{s}{d}": f"extract{d}" for d in range(3)
                          for s in ("extract", "classify")}
    grown = GrowingPlan(_doc_graph(1), CompileOptions())  # then two documents appended
    grown.add(graph.nodes[2:])
    assert grown.plan().chain == plan.chain
    assert grown.plan().chain_members == {f"extract{d}": [f"extract{d}", f"classify{d}"]
                                          for d in range(3)}
