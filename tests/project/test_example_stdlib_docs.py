"""The main example: corpus, local index, and the pipeline on the fake engine."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import zlib

import pytest
from pydantic import ValidationError

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


def test_key_terms_can_only_be_phrases_of_the_modules_own_text():
    """Each document's extract contract lists its own phrases as the key terms' enum, so
    the engine decodes no other; words from the system prompt that the text does not
    hold ("file format", "network") fail the contract (issue 38 item 4)."""
    docs = load_documents()
    for doc in docs:
        schema = pipeline.facts_model(doc).model_json_schema()
        enum = schema["properties"]["key_terms"]["items"]["enum"]
        assert enum and all(pipeline.grounded(t, doc.text) for t in enum), doc.name
        assert schema["properties"]["key_terms"]["maxItems"] == 3
    json_doc = next(d for d in docs if d.name == "json")
    facts = pipeline.facts_model(json_doc)
    ok = facts.model_validate({"purpose": "Provides JSON.", "key_terms": ["data interchange"]})
    assert isinstance(ok, pipeline.ModuleFacts)
    for copied in (["file format"], ["network"], ["netwerk"]):
        with pytest.raises(ValidationError):
            facts.model_validate({"purpose": "Provides JSON.", "key_terms": copied})
    assert not pipeline.grounded("file format", json_doc.text)
    assert pipeline.grounded("Data  Interchange", "a lightweight data\ninterchange format")
    assert "mod" not in pipeline.candidate_terms(json_doc.text)  # reST roles are markup


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
    assert ("key terms found word for word in their module's documentation: 3/3 (every "
            "term found for 3/3 documents)") in text
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert records[0]["type"] == "run" and len(records) == 1 + 12


async def test_pipeline_classifies_on_the_cascade_of_its_config(aiohttp_client, tmp_path,
                                                               monkeypatch):
    from pathlib import Path

    from flowlift.proxy import create_app
    from flowlift.proxy.config import load_config
    from flowlift.proxy.state import STATE
    from flowlift.testing import FakeEngine, default_responder

    config = load_config(Path(pipeline.__file__).with_name("flowlift.toml"))
    def responder(request):  # a label that depends on the document, so do its logprobs
        c = request.constraint
        if c is not None and c.choices:
            return c.choices[zlib.crc32(request.messages[-1].content.encode()) % len(c.choices)]
        return default_responder(request)

    def logprob(token):  # the fake is unsure of two areas only
        return -2.0 if token.strip() in ("networking", "text", "processing") else -0.05

    # the config's cascade is two distinct embedded models (the Qwen2.5-Coder pair)
    small, large = config.embedded_models()
    assert (small, large) == ("Qwen2.5-Coder-0.5B-Instruct", "Qwen2.5-Coder-1.5B-Instruct")
    engines = {name: FakeEngine([name], responder=responder, logprob=logprob)
               for name in (small, large)}
    app = create_app(engines, file_config=config)
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    monkeypatch.setenv("FLOWLIFT_BASE_URL", str(client.make_url("")).rstrip("/"))
    trace = tmp_path / "t.jsonl"
    out = io.StringIO()

    def run() -> int:
        with contextlib.redirect_stdout(out):
            return pipeline.main(["--limit", "6", "--trace", str(trace)])

    assert await asyncio.to_thread(run) == 0, out.getvalue()
    assert "classify cascade small -> large (confidence floor 0.9): " in out.getvalue()
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    labels = [r for r in records if r.get("name") == "classify"]
    assert len(labels) == 6 and all(r["attempts"][0]["model"] == "small" for r in labels)
    moved = [r for r in labels if len(r["attempts"]) > 1]
    assert all(r["attempts"][0]["outcome"] == "low_confidence" for r in moved)
    assert all(r["attempts"][-1]["model"] == "large" for r in moved)
    # each cascade name reached its own engine: small took every first attempt
    assert engines[small].requests and len(engines[large].requests) == len(moved)
    counts = app[STATE].runs.outcomes.counts("classify", "small")
    assert counts.items == 6 and counts.failures == len(moved)
    # labels the fake is unsure of fall under the floor, the others do not
    assert 0 < len(moved) < 6
