"""The main example: corpus, local index, and the pipeline on the fake engine."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json

from examples.stdlib_docs import pipeline
from examples.stdlib_docs.corpus import MAX_CHARS, MIN_CHARS, load_documents, truncate
from examples.stdlib_docs.index import BM25Index


def test_corpus_is_real_bounded_and_unique():
    docs = load_documents()
    assert len(docs) >= 30
    assert len({d.name for d in docs}) == len(docs)
    assert all(MIN_CHARS <= len(d.text) <= MAX_CHARS for d in docs)
    assert all(d.source.startswith("Python ") for d in docs)
    import json as json_module

    json_doc = next(d for d in docs if d.name == "json")
    assert json_doc.text.split()[0] in (json_module.__doc__ or "").split()[:3]
    assert load_documents(5) == docs[:5]
    assert len(truncate(docs[0].text, 120)) <= 120


def test_bm25_ranks_and_excludes():
    index = BM25Index({"a": "json encoder", "b": "socket server", "c": "json decoder"})
    hits = index.search("json", 3, exclude=["a"])
    assert [name for name, _ in hits] == ["c"] and hits[0][1] > 0


def test_related_tool_fills_to_three_other_modules():
    facts = pipeline.ModuleFacts(purpose="Provides x.", key_terms=["zzz"])
    rel = pipeline.related_modules(facts, "json")
    assert len(rel["modules"]) == 3 and "json" not in rel["modules"]
    assert all(isinstance(score, float) for score in rel["scores"])
    facts = pipeline.ModuleFacts(purpose="Provides sockets.", key_terms=["socket server"])
    assert "socketserver" in pipeline.related_modules(facts, "socket")["modules"]


async def test_pipeline_runs_on_the_fake_engine(client, tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWLIFT_BASE_URL", str(client.make_url("")).rstrip("/"))
    trace = tmp_path / "t.jsonl"
    out = io.StringIO()

    def run() -> int:
        with contextlib.redirect_stdout(out):
            return pipeline.main(["--limit", "3", "--trace", str(trace)])

    assert await asyncio.to_thread(run) == 0
    text = out.getvalue()
    assert "licence: Python Software Foundation License" in text
    assert "module" in text and "summary" in text and "tool_wait" in text
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert records[0]["type"] == "run" and len(records) == 1 + 12
