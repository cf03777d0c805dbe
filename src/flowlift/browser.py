"""The compile page's entry point: ``flowlift compile --local`` as a function of the pasted
text, for the compiler running in the browser (Pyodide, see
:mod:`flowlift.proxy.ui.offline`). Pure: no I/O, no proxy, default cost figures and the
approximate tokenizer, as a local compile without ``--price`` or a state database.
"""

from __future__ import annotations

import json
from typing import Any

from flowlift.compiler import CompileOptions, compile_graph
from flowlift.dataflow import validate
from flowlift.errors import GraphError
from flowlift.graph import Graph
from flowlift.report import format_report


def compile_text(text: str) -> dict[str, Any]:
    """Compile a pasted graph document.

    Args:
        text: a graph in the wire format (``wf.graph().to_json()``), or a document that
            holds one under ``"graph"`` (a workflow's recorded graph, as the compile page
            fills in for ``/ui/compile?run=RUN_ID``).

    Returns:
        ``{"report": <CompileReport as JSON>, "text": <what flowlift compile prints>}``,
        or ``{"problems": [...]}``: each line as ``flowlift compile`` prints it (without
        its ``flowlift compile:`` prefix) for a document that is not JSON or not a valid
        graph.
    """
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return {"problems": [f"not JSON: {exc}"]}
    if isinstance(doc, dict) and "nodes" not in doc and isinstance(doc.get("graph"), dict):
        doc = doc["graph"]
    try:
        graph = Graph.model_validate(doc)
        validate(graph)
    except (GraphError, ValueError) as exc:
        return {"problems": [str(exc)]}
    report = compile_graph(graph, CompileOptions()).report
    return {"report": report.model_dump(mode="json"), "text": format_report(report)}
