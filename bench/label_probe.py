"""What a model answers to the stdlib_docs labelling question, without the engine.

For each of the 42 documents the chat-templated prompt goes through the converted
checkpoint with transformers once; the label is the arg-max over the six areas' first
tokens at the answer's start. That is the decision the engine's guided choice makes
(the six areas begin with six different tokens), so the figures match the engine's
greedy, choice-constrained label (checked: the 0.5B's 8/42, all ``data formats``, is
what the demo's real run gave). ``p_top`` is that choice's probability renormalised
over the six first tokens, a stand-in for the cascade's confidence.

Prompts (``--prompts``): ``plain`` (the question as before issue 26: the areas named),
``hints`` (each area described: the pipeline's ``AREA_HINTS``); the module is
described by its docstring's first paragraph (the pipeline gives the extracted
purpose instead).

Run: ``.venv/bin/python bench/label_probe.py MODEL_DIR [--prompts plain,hints]``
(one thread, niced by the caller; ~2-5 min a prompt for the 0.5B/1.5B on a loaded 2-core
machine). ``--smoke``: the suite's SmolLM2-135M on 3 documents (plumbing only).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.stdlib_docs.corpus import AREAS, Document, load_documents
from examples.stdlib_docs.pipeline import AREA_HINTS, PREAMBLE


def prompt(doc: Document, kind: str) -> list[dict[str, str]]:
    """The labelling messages of ``doc`` (``kind``: ``plain`` or ``hints``)."""
    about = doc.text.split("\n\n")[0][:300]
    if kind == "plain":
        ask = (f"Which area is the {doc.name} module in: {', '.join(AREAS[:-1])}, or "
               f"{AREAS[-1]}?")
    else:
        areas = ", ".join(f"{area} ({AREA_HINTS[area]})" for area in AREAS)
        ask = (f"Which area is the {doc.name} module in? The areas: {areas}. Answer with "
               "the area's name.")
    return [{"role": "system", "content": PREAMBLE},
            {"role": "user", "content": f"The {doc.name} module: {about}\n{ask}"}]


def probe(model_dir: Path, kinds: list[str], docs: list[Document]) -> list[dict[str, Any]]:
    """One row per prompt kind: right labels, label counts, mean p_top right/wrong."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
    firsts = [tok.encode(a, add_special_tokens=False)[0] for a in AREAS]
    rows = []
    for kind in kinds:
        t0 = time.monotonic()
        got: list[str] = []
        p_right: list[float] = []
        p_wrong: list[float] = []
        for doc in docs:
            ids = tok.apply_chat_template(prompt(doc, kind), add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
            with torch.no_grad():
                logits = model(ids).logits[0, -1, firsts].float()
            probs = torch.softmax(logits, dim=0)
            best = int(torch.argmax(probs))
            got.append(AREAS[best])
            (p_right if AREAS[best] == doc.reference_area else p_wrong).append(
                float(probs[best]))
        rows.append({"prompt": kind, "right": len(p_right), "items": len(docs),
                     "labels": dict(Counter(got)), "s": round(time.monotonic() - t0),
                     "p_top_right": _mean(p_right), "p_top_wrong": _mean(p_wrong)})
    return rows


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 3) if xs else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?", help="a converted checkpoint folder")
    parser.add_argument("--prompts", default="plain,hints")
    parser.add_argument("--smoke", action="store_true",
                        help="SmolLM2-135M from the model cache, 3 documents")
    args = parser.parse_args(argv)
    docs = load_documents(3 if args.smoke else None)
    if args.smoke:
        from flowlift.local_engine.models import ensure_default_model

        args.model_dir = str(ensure_default_model())
    if not args.model_dir:
        parser.error("give MODEL_DIR (e.g. .cache/flowlift/models/Qwen2.5-Coder-1.5B-Instruct)")
    for row in probe(Path(args.model_dir), args.prompts.split(","), docs):
        print(f"{Path(args.model_dir).name} {row['prompt']:<6} {row['right']}/{row['items']} "
              f"in {row['s']} s; labels {row['labels']}; mean p_top right "
              f"{row['p_top_right']}, wrong {row['p_top_wrong']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
