"""Write a consolidated batch graph (Halo-style: many workflow instances in one DAG).

The example pipeline over ``--docs`` documents (the 42 standard-library docstrings,
cycled, each copy tagged) recorded with ``workflow(..., submit=False)``: 4 steps per
document, so ``--docs 2500`` gives 10,000 nodes.

    .venv/bin/python bench/make_batch_graph.py --docs 2500 --out runs/batch10k.graph.json
    .venv/bin/flowlift compile --local runs/batch10k.graph.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.stdlib_docs import pipeline as ex
from examples.stdlib_docs.corpus import load_documents
from flowlift import workflow


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=2500)
    parser.add_argument("--out", default="runs/batch10k.graph.json")
    args = parser.parse_args()
    base = load_documents()
    with workflow("batch-consolidated", workflow_class="batch", submit=False) as wf:
        for i in range(args.docs):
            d = base[i % len(base)]
            doc = dataclasses.replace(d, text=f"[copy {i}]\n{d.text}")
            facts = ex.extract(doc)
            label = ex.classify(doc, facts)
            ex.summarize(doc, facts, label, ex.related(facts, doc.name))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(wf.graph().to_wire()))
    print(f"{len(wf.nodes)} nodes -> {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
