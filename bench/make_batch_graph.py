"""Write a consolidated batch graph (Halo-style: many workflow instances in one DAG).

The example pipeline over ``--docs`` documents (the 42 standard-library docstrings,
cycled, each copy tagged) recorded with ``workflow(..., submit=False)``: 4 steps per
document, so ``--docs 2500`` gives 10,000 nodes.

    .venv/bin/python bench/make_batch_graph.py --docs 2500 --out runs/batch10k.graph.json
    .venv/bin/flowlift compile --local runs/batch10k.graph.json
    .venv/bin/python bench/make_batch_graph.py --smoke   # 10 documents, compiled, temp file
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.stdlib_docs import pipeline as ex
from examples.stdlib_docs.corpus import load_documents
from flowlift import workflow


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=2500)
    parser.add_argument("--out", default="runs/batch10k.graph.json")
    parser.add_argument("--smoke", action="store_true",
                        help="10 documents into a temporary file, then `flowlift compile "
                             "--local` on it")
    args = parser.parse_args()
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            out = write(10, Path(tmp) / "batch.graph.json")
            return subprocess.run([sys.executable, "-m", "flowlift.cli", "compile", "--local",
                                   str(out)], check=False).returncode
    write(args.docs, Path(args.out))
    return 0


def write(docs: int, out: Path) -> Path:
    """Record the example over ``docs`` documents and write its graph to ``out``."""
    base = load_documents()
    with workflow("batch-consolidated", workflow_class="batch", submit=False) as wf:
        for i in range(docs):
            d = base[i % len(base)]
            doc = dataclasses.replace(d, text=f"[copy {i}]\n{d.text}")
            facts = ex.extract(doc)
            label = ex.classify(doc, facts)
            ex.summarize(doc, facts, label, ex.related(facts, doc.name))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(wf.graph().to_wire()))
    print(f"{len(wf.nodes)} nodes -> {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return out


if __name__ == "__main__":
    sys.exit(main())
