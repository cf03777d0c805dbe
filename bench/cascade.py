"""Cascade vs always-large on a labelled task: pass rate and cost for small-only,
large-only and the cascade small -> large.

The task: label each of the 42 Python standard-library module docstrings of
``examples/stdlib_docs`` (real text, PSF License) with one of six documentation areas;
the reference labels are ``examples.stdlib_docs.corpus.MODULES`` (filed by hand by
the example's author). A step *passes* when its contract holds (one of the six labels)
AND the label equals the reference. Cost = tokens (prompt + completion, every attempt,
as the engines counted them) x the configured price per 1,000 tokens of the model.

The models, honestly (no larger chat model is available offline here):

* ``small``: SmolLM2-135M-Instruct on the embedded vLLM engine, choice-constrained.
* ``large`` with ``--engine vllm``: the *same weights* behind a second configured
  backend, an OpenAI-compatible upstream (a shim in this file on 127.0.0.1) that gives
  the model a stronger prompt: six labelled examples of other stdlib modules before the
  question (few-shot), then asks the proxy's embedded engine for a JSON-enum answer.
  Its quality is measured, but it is a stronger *prompt*, not a larger model; its price
  is set 30x the small one's as for a real large model.
* ``--engine pair``: two distinct models (issue 26): ``small`` is
  Qwen2.5-Coder-0.5B-Instruct and ``large`` Qwen2.5-Coder-1.5B-Instruct, each its own
  embedded vLLM engine (the stdlib_docs example's pair), both with the same prompt.
  Prices are in proportion to the parameter counts (0.5 and 1.5 per 1,000 tokens): what
  a token costs in compute on one machine. With a 3x price ratio a cascade that sends
  every item to ``small`` first costs at least a third of always-large, so P6's "<= 30%
  of large's cost" is out of reach for this pair by construction; the bench says so.
* ``large`` with ``--engine fake``: a scripted upstream that answers the reference label
  for 90% of the documents (a stated, simulated accuracy) and FakeEngine as ``small``:
  the quality axis is simulated there; only the escalation and cost mechanics are real.

Run: ``.venv/bin/python bench/cascade.py --engine pair`` (two engine loads, 4 x 42
labels plus the escalations) or ``--engine vllm`` (a few minutes on 2 CPU
cores: one engine load, 3 x 42 labels plus the escalations) or ``--engine fake``
(seconds). Writes ``bench/results/cascade.<engine>.json``. ``--smoke``: the fake
engine on 8 documents, one floor, its log and results in a temporary folder (the
plumbing in seconds; tests/project/test_bench_smoke.py runs it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.stdlib_docs.corpus import AREAS, Area, Document, load_documents
from examples.stdlib_docs.pipeline import AREA_HINTS, PREAMBLE
from flowlift import step, workflow
from flowlift.testing import free_port, running_proxy

RESULTS = Path(__file__).resolve().parent / "results"
# the checkout's model cache (the default is the user's ~/.cache/flowlift)
os.environ.setdefault("FLOWLIFT_CACHE_DIR",
                      str(Path(__file__).resolve().parents[1] / ".cache" / "flowlift"))
PRICES = {"small": 0.02, "large": 0.6}  # per 1,000 tokens; large = 30x small
PAIR = {"small": "Qwen2.5-Coder-0.5B-Instruct", "large": "Qwen2.5-Coder-1.5B-Instruct"}
PAIR_PRICES = {"small": 0.5, "large": 1.5}  # in proportion to the parameter counts
SIMULATED_LARGE_ACCURACY = 0.9

# Labelled examples for the few-shot "large" prompt: other stdlib modules, not in the
# 42 documents (described in our own words).
FEW_SHOT = [
    ("tomllib", "Parses TOML documents into Python dictionaries.", "data formats"),
    ("textwrap", "Wraps and fills paragraphs of text to a given line width.",
     "text processing"),
    ("imaplib", "An IMAP4 client: reads and manages mail on a server over the network.",
     "networking"),
    ("shutil", "High-level file operations: copy, move and remove files and directory "
     "trees.", "files and processes"),
    ("pdb", "An interactive source-code debugger for Python programs.", "developer tools"),
    ("fractions", "Rational numbers: exact arithmetic on fractions.", "math and algorithms"),
]


def question(doc: Document) -> str:
    """The docstring, then the pipeline's question (each area described: AREA_HINTS)."""
    areas = ", ".join(f"{area} ({AREA_HINTS[area]})" for area in AREAS)
    return (f"Documentation of the {doc.name} module:\n{doc.text}\n\nWhich area is the "
            f"{doc.name} module in? The areas: {areas}. Answer with the area's name.")


def few_shot_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stronger prompt: the preamble, six solved examples, then the question."""
    user = [m for m in messages if m["role"] == "user"][-1]["content"]
    shots: list[dict[str, Any]] = []
    for name, text, area in FEW_SHOT:
        shots += [{"role": "user", "content": f"Documentation of the {name} module:\n{text}"
                   f"\n\nWhich area is the {name} module in?"},
                  {"role": "assistant", "content": area}]
    return [{"role": "system", "content": PREAMBLE}, *shots,
            {"role": "user", "content": user}]


class Shim:
    """An OpenAI-compatible ``/chat/completions`` (streamed) upstream on 127.0.0.1.

    ``role="large"`` with ``engine="vllm"``: the few-shot prompt on the proxy's own
    embedded model. With ``engine="fake"`` both tiers are scripted from a CRC of the
    module name (stated rates, no model): ``small`` answers the reference label for
    55% of the documents, another valid label for 20% and an invalid one ("unsure",
    failing the contract) for 25%; ``large`` the reference label for 90%.
    """

    def __init__(self, role: str, engine: str) -> None:
        self.role, self.engine = role, engine
        self.proxy_url = ""  # set once the proxy is up (the vllm shim forwards to it)
        self.client = httpx.AsyncClient(timeout=600)

    def scripted(self, body: dict[str, Any]) -> tuple[str, dict[str, int]]:
        user = next(m for m in body["messages"] if m["role"] == "user")["content"]
        name = user.split("Documentation of the ", 1)[1].split(" module", 1)[0]
        ref = next(d.reference_area for d in load_documents() if d.name == name)
        wrong = next(a for a in AREAS if a != ref)
        roll = zlib.crc32(f"{self.role}:{name}".encode()) % 100
        if self.role == "large":
            label = ref if roll < SIMULATED_LARGE_ACCURACY * 100 else wrong
        else:
            label = ref if roll < 55 else wrong if roll < 75 else "unsure"
        extra = 300 if self.role == "large" else 0  # the large prompt is longer
        return label, {"prompt_tokens": len(user.split()) * 4 // 3 + extra,
                       "completion_tokens": 3}

    async def answer(self, body: dict[str, Any]) -> tuple[str, dict[str, int]]:
        if self.engine == "fake":
            return self.scripted(body)
        r = await self.client.post(f"{self.proxy_url}/v1/chat/completions", json={
            "model": "small", "messages": few_shot_messages(body["messages"]),
            "max_tokens": 16, "temperature": 0, "response_format": {
                "type": "json_schema", "json_schema": {"name": "area", "schema": {
                    "type": "string", "enum": list(AREAS)}}}})
        doc = r.json()
        if r.status_code != 200:
            raise web.HTTPBadGateway(text=json.dumps(doc))
        text = doc["choices"][0]["message"]["content"]
        with contextlib.suppress(ValueError):  # not JSON: the contract check rejects it
            text = json.loads(text)
        return str(text), doc["usage"]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        label, usage = await self.answer(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for doc in ({"choices": [{"index": 0, "delta": {"content": label}}]},
                    {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                    {"choices": [], "usage": usage}):
            await resp.write(b"data: " + json.dumps(doc).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def serve(self, port: int) -> None:
        """Run on 127.0.0.1:``port`` in a daemon thread (its own event loop)."""
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)

        def run() -> None:
            loop = asyncio.new_event_loop()
            runner = web.AppRunner(app)
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
            loop.run_forever()

        threading.Thread(target=run, daemon=True).start()


def pair_toml() -> str:
    """Both cascade names on their own embedded model (:data:`PAIR`)."""
    return "".join(f"""
[backends.{role}-engine]
kind = "embedded"
model = "{model}"
[models."{role}"]
backends = ["{role}-engine"]
price_per_1k_tokens = {PAIR_PRICES[role]}
""" for role, model in PAIR.items())


def config_toml(shim_ports: dict[str, int]) -> str:
    small = "small-shim" if "small" in shim_ports else "local"
    shims = "".join(f"""
[backends.{role}-shim]
kind = "openai"
base_url = "http://127.0.0.1:{port}/v1"
first_token_timeout_s = 600
""" for role, port in shim_ports.items())
    return f"""
[backends.local]
kind = "embedded"
{shims}
[models."small"]
backends = ["{small}"]
price_per_1k_tokens = {PRICES["small"]}
[models."large"]
backends = ["large-shim"]
price_per_1k_tokens = {PRICES["large"]}
"""


def run_mode(mode: str, docs: list[Document], floor: float | None = None) -> dict[str, Any]:
    model: Any = {"small": "small", "large": "large", "cascade": ["small", "large"]}[mode]
    name = f"label_{mode}" + (f"_{floor}" if floor is not None else "")

    @step(model=model, output=Area, max_tokens=8, name=name, min_confidence=floor)
    def label(doc: Document) -> list[dict[str, str]]:
        return [{"role": "system", "content": PREAMBLE},
                {"role": "user", "content": question(doc)}]

    t0 = time.monotonic()
    try:
        with workflow(f"cascade-bench-{mode}", workflow_class="batch") as wf:
            outs = [label(d) for d in docs]
    except Exception as exc:  # failed steps are counted below, not fatal
        print(f"[{mode}] {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    wall_s = time.monotonic() - t0
    steps = {r["step_id"]: r for r in wf.trace if r.get("type") == "step"}
    passed = cost = tokens = 0.0
    escalated = 0
    confidences: list[float] = []
    labels: list[str | None] = []
    first_confidence: list[float | None] = []
    for doc, out in zip(docs, outs, strict=True):
        rec = steps[out.step_id]
        value = None if out.step_id in wf.failures else out.value
        labels.append(value)
        first_confidence.append(rec["attempts"][0].get("confidence"))
        ok = value == doc.reference_area
        passed += ok
        escalated += len({a["model"] for a in rec["attempts"]}) > 1
        for a in rec["attempts"]:
            n = a["prompt_tokens"] + a["completion_tokens"]
            tokens += n
            cost += n / 1000 * PRICES[a["model"]]
            if a.get("confidence") is not None:
                confidences.append(a["confidence"])
    n = len(docs)
    return {"mode": mode if floor is None else f"cascade@{floor}", "floor": floor,
            "items": n, "pass_rate": round(passed / n, 4), "labels": labels,
            "first_confidence": first_confidence,
            "contract_failures": len(wf.failures), "escalated": escalated,
            "tokens": int(tokens), "cost": round(cost, 6), "wall_s": round(wall_s, 1),
            "confidences": sorted(round(c, 3) for c in confidences)}


def calibration(docs: list[Document], small: dict[str, Any],
                cascade: dict[str, Any]) -> dict[str, Any]:
    """Is the small model's confidence higher when its label is right? (Greedy decoding:
    the cascade's first attempt is the small-only run's answer.)"""
    right, wrong = [], []
    for doc, label, conf in zip(docs, small["labels"], cascade["first_confidence"],
                                strict=True):
        if conf is not None:
            (right if label == doc.reference_area else wrong).append(conf)

    def mean(xs: list[float]) -> float | None:
        return round(sum(xs) / len(xs), 3) if xs else None

    return {"right": len(right), "wrong": len(wrong), "mean_confidence_right": mean(right),
            "mean_confidence_wrong": mean(wrong)}


def floor_sweep(docs: list[Document], small: dict[str, Any], large: dict[str, Any],
                first_confidence: list[float | None],
                floors: tuple[float, ...] = (0.7, 0.75, 0.8, 0.85, 0.9)
                ) -> list[dict[str, Any]]:
    """Cascades at other floors, derived from the runs (greedy decoding: an item keeps
    the small-only label when its first confidence reaches the floor, else takes the
    large-only label). Cost: all of small's plus large's mean cost per item for each
    escalated item. Returns one row per floor."""
    n = len(docs)
    large_pass = sum(lab == d.reference_area for lab, d in zip(large["labels"], docs,
                                                              strict=True))
    rows = []
    for floor in floors:
        kept = [c is not None and c >= floor for c in first_confidence]
        labels = [s if k else g for s, g, k in zip(small["labels"], large["labels"], kept,
                                                  strict=True)]
        passed = sum(lab == d.reference_area for lab, d in zip(labels, docs, strict=True))
        escalated = n - sum(kept)
        cost = small["cost"] + large["cost"] * escalated / n
        rows.append({"floor": floor, "passed": passed, "escalated": escalated,
                     "pass_vs_large": round(passed / large_pass, 3) if large_pass else None,
                     "cost_vs_large": round(cost / large["cost"], 3) if large["cost"] else None})
    return rows


def cascade_graph(docs: list[Document], floor: float) -> dict[str, Any]:
    """The cascade run's graph, for the compiler's estimate after the runs."""
    def node(i: int, doc: Document) -> dict[str, Any]:
        return {"kind": "llm", "id": f"label_{i}", "name": f"label_cascade_{floor}",
                "cascade": ["small", "large"], "min_confidence": floor,
                "contract": {"choices": list(AREAS)}, "params": {"max_tokens": 8},
                "messages": [{"role": "system", "content": [{"text": PREAMBLE}]},
                             {"role": "user", "content": [{"text": question(doc)}]}]}
    return {"nodes": [node(i, d) for i, d in enumerate(docs)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--engine", choices=("vllm", "fake", "pair"), default="vllm")
    parser.add_argument("--limit", type=int, default=None, help="first N documents")
    parser.add_argument("--floors", default="0.7,0.8",
                        help="confidence floors of the cascade runs (default 0.7,0.8)")
    parser.add_argument("--base-url", default=None,
                        help="with --engine pair: use this running proxy (started with "
                             "--config examples/stdlib_docs/flowlift.toml) instead of "
                             "starting one")
    parser.add_argument("--smoke", action="store_true",
                        help="fake engine, 8 documents, floor 0.7, nothing in bench/results")
    args = parser.parse_args(argv)
    if args.smoke:
        args.engine, args.limit, args.floors = "fake", 8, "0.7"
    docs = load_documents(args.limit)
    if args.engine == "pair":
        PRICES.update(PAIR_PRICES)
    roles = {"fake": ("small", "large"), "vllm": ("large",), "pair": ()}[args.engine]
    shims = {role: Shim(role, args.engine) for role in roles}
    ports = {role: free_port() for role in shims}
    for role, shim in shims.items():
        shim.serve(ports[role])
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp) if args.smoke else RESULTS
        out_dir.mkdir(parents=True, exist_ok=True)
        summary = run_all(args, docs, Path(tmp), out_dir, ports, shims)
        report(summary, out_dir / f"cascade.{args.engine}.json")
    return 0


def run_all(args: argparse.Namespace, docs: list[Document], tmp: Path, out_dir: Path,
            ports: dict[str, int], shims: dict[str, Shim]) -> dict[str, Any]:
    """The proxy (with the shims as upstreams), every mode's run and the compiler's
    report after them; returns the summary."""
    cfg = tmp / "cascade.toml"
    cfg.write_text(pair_toml() if args.engine == "pair" else config_toml(ports))
    engine = "vllm" if args.engine == "pair" else args.engine
    serve = ("--config", str(cfg), "--engine", engine, "--state-db",
             str(tmp / "state.sqlite"), "--log-level", "warning")
    started = (contextlib.nullcontext((args.base_url, None)) if args.base_url
               else running_proxy(*serve, log_path=out_dir / "cascade.log"))
    with started as (base, _):
        for shim in shims.values():
            shim.proxy_url = base
        os.environ["FLOWLIFT_BASE_URL"] = base
        floors = [float(f) for f in args.floors.split(",")]
        rows = [run_mode("small", docs), run_mode("large", docs),
                *(run_mode("cascade", docs, f) for f in floors)]
        graph = cascade_graph(docs, floors[0])
        compiled = httpx.post(f"{base}/v1/workflows:compile", json=graph,
                              timeout=120).json()
    small, large, cascades = rows[0], rows[1], rows[2:]
    summary = {
        "engine": args.engine, "documents": len(docs), "prices_per_1k": PRICES,
        "modes": rows,
        "cascade_vs_large": [{
            "floor": c["floor"], "cost_ratio": round(c["cost"] / large["cost"], 3),
            "pass_rate_delta": round(c["pass_rate"] - large["pass_rate"], 4)}
            for c in cascades],
        "p6": [{"floor": c["floor"], "pass_rate_vs_large": (
            round(c["pass_rate"] / large["pass_rate"], 3) if large["pass_rate"] else None),
            "cost_vs_large": round(c["cost"] / large["cost"], 3),
            "met": bool(large["pass_rate"]) and c["pass_rate"] >= 0.95 * large["pass_rate"]
            and c["cost"] <= 0.3 * large["cost"]} for c in cascades],
        "calibration": calibration(docs, small, cascades[0]),
        "floor_sweep": floor_sweep(docs, small, large, cascades[0]["first_confidence"]),
        "compiler_after_runs": compiled.get("cascade_totals"),
        "learned_failure_rates": (compiled.get("cascades") or [{}])[0].get("failure_rates"),
        "floors": floors}
    return summary


def report(summary: dict[str, Any], out: Path) -> None:
    """Write ``summary`` to ``out`` and print its table."""
    rows, floors = summary["modes"], summary["floors"]
    out.write_text(json.dumps(summary, indent=1))
    print(f"\n{'mode':<12} {'pass':>6} {'contract fail':>13} {'escalated':>9} {'tokens':>7} "
          f"{'cost':>8} {'wall s':>7}")
    for r in rows:
        print(f"{r['mode']:<12} {r['pass_rate']:>6.1%} {r['contract_failures']:>13} "
              f"{r['escalated']:>9} {r['tokens']:>7} {r['cost']:>8.4f} {r['wall_s']:>7}")
    print(f"cascade vs large-only: {summary['cascade_vs_large']}")
    print(f"P6 (>= 95% of large's pass rate at <= 30% of its cost): {summary['p6']}")
    print(f"small model's confidence: {summary['calibration']}")
    print("other floors, derived from the runs (greedy): " + "; ".join(
        f"{r['floor']}: {r['passed']}/{summary['documents']} passed, {r['escalated']} "
        f"escalated, {r['pass_vs_large']} of large's pass rate at {r['cost_vs_large']} of "
        "its cost" for r in summary["floor_sweep"]))
    print(f"compiler's estimate after the runs (floor {floors[0]}): "
          f"{summary['compiler_after_runs']}")
    print(f"written to {out}")


if __name__ == "__main__":
    sys.exit(main())
