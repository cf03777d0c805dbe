"""Tracing overhead: the same proxy with tracing on and off, side by side in one run.

Two ``flowlift serve --engine fake`` processes (no model: what is measured is the
proxy's own work): ``traced`` with the default set-up (spans of every request and run,
exported as JSON lines by the background batch processor into a temporary trace dir,
Prometheus metrics) and ``untraced`` with ``OTEL_SDK_DISABLED=true`` (OpenTelemetry's
own switch: no-op tracer; metrics still on). Requests alternate between the two, one at
a time, so drift hits both alike:

* ``chat``: non-streamed chat completions; ``stream``: streamed ones (the fake engine
  sends ~10 chunks); ``workflow``: ``POST /v1/workflows`` with a 24-step graph (8
  chains of 3), read to ``run.finished``;
* ``forward`` / ``forward-stream``: the same chat request forwarded to an upstream
  (``bench/fake_upstream.py``, canned bytes, 20 chunks a stream): the proxy's fastest
  path, where tracing's share is largest.

Reported per path and kind: p50 / p99 end-to-end latency (ms) and server CPU time per
request (utime + stime of the server process from ``/proc``, ms; the ``forward`` kinds
run 4x ``--requests``, being fast). Servers and the fake upstream are pinned to core 1
and this load generator to core 0 when there are two cores.

    .venv/bin/python bench/tracing_overhead.py [--requests 300] [--runs 30]
    .venv/bin/python bench/tracing_overhead.py --export-only   # the in-process figures
    .venv/bin/python bench/tracing_overhead.py --smoke   # seconds: plumbing only, no file

Writes ``bench/results/tracing_overhead.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench.harness import pct, save
from flowlift.testing import free_port, running_proxy

CLK_TCK = os.sysconf("SC_CLK_TCK")
CHAT = {"model": "default", "max_tokens": 32,
        "messages": [{"role": "user", "content": "Say hello to the tracing benchmark."}]}
KINDS = ("chat", "stream", "forward", "forward-stream", "workflow")
CONFIG = """[backends.fake]
kind = "openai"
base_url = "{url}/v1"

[models."bench-model"]
backends = ["fake"]
"""


def graph() -> dict[str, Any]:
    nodes: list[dict[str, Any]] = []
    for c in range(8):
        prev = None
        for s in range(3):
            content: list[dict[str, Any]] = [{"text": f"chain {c} step {s}: "}]
            if prev:
                content.append({"ref": prev, "path": []})
            nodes.append({"kind": "llm", "id": f"c{c}s{s}", "params": {"max_tokens": 16},
                          "messages": [{"role": "user", "content": content}]})
            prev = f"c{c}s{s}"
    return {"name": "bench", "nodes": nodes}


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


async def one(client: httpx.AsyncClient, base: str, kind: str) -> float:
    t0 = time.perf_counter()
    if kind == "workflow":
        async with client.stream("POST", f"{base}/v1/workflows", json=graph()) as r:
            body = b"".join([c async for c in r.aiter_bytes()])
            assert b"run.finished" in body and b'"succeeded"' in body, body[-300:]
    else:
        body = {**CHAT, "stream": kind.endswith("stream"),
                "model": "bench-model" if kind.startswith("forward") else "default"}
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for _ in r.aiter_bytes():
                pass
    return (time.perf_counter() - t0) * 1000


async def measure(servers: dict[str, tuple[str, int]], kind: str, n: int) -> dict[str, Any]:
    lat: dict[str, list[float]] = {p: [] for p in servers}
    cpu: dict[str, float] = dict.fromkeys(servers, 0.0)
    async with httpx.AsyncClient(timeout=120) as client:
        for _ in range(min(20, n)):  # warm-up
            for base, _pid in servers.values():
                await one(client, base, kind)
        for i in range(n):
            order = list(servers) if i % 2 == 0 else list(reversed(servers))
            for path in order:
                base, pid = servers[path]
                c0 = cpu_s(pid)
                lat[path].append(await one(client, base, kind))
                cpu[path] += cpu_s(pid) - c0
    return {p: {"p50_ms": pct(lat[p], 50), "p99_ms": pct(lat[p], 99),
                "cpu_ms_per_request": cpu[p] * 1000 / n, "n": n} for p in servers}


def export_cost(runs: int = 50, steps: int = 24) -> dict[str, float]:
    """In process: ms to serialise one ``steps``-step run's spans, OpenTelemetry's
    ``ReadableSpan.to_json`` vs the JSON-lines exporter's records (median of 5)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from flowlift.tracing import AttemptTrace, RunTrace
    from flowlift.tracing.run_spans import RunSpans
    from flowlift.tracing.spans import JsonLinesSpanExporter

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("bench")
    t0 = time.perf_counter()
    for _ in range(runs):
        trace = RunTrace("wf-bench", "bench")
        for i in range(steps):
            st = trace.add_step(f"s{i}", "llm", "s", "m")
            st.ready_ms, st.started_ms, st.first_token_ms = 1.0, 2.0, 3.0
            st.generated_ms, st.finished_ms, st.status = 4.0, 5.0, "done"
            st.attempts = [AttemptTrace(1, "m", 2.0, 3.0, 5.0, "ok", 50, 20, 10)]
        trace.finish("succeeded")
        RunSpans(tracer, trace, None, lambda _: "vllm", {}).close()
    build_ms = (time.perf_counter() - t0) * 1000 / runs
    spans = memory.get_finished_spans()
    with tempfile.TemporaryDirectory() as d:
        exporter = JsonLinesSpanExporter(Path(d) / "spans.jsonl")
        ours, otel = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            exporter.export(spans)
            ours.append((time.perf_counter() - t0) * 1000 / runs)
            t0 = time.perf_counter()
            "".join(s.to_json(indent=None) + "\n" for s in spans)
            otel.append((time.perf_counter() - t0) * 1000 / runs)
        exporter.shutdown()
    return {"spans_per_run": len(spans) / runs, "build_ms_per_run": build_ms,
            "jsonl_export_ms_per_run": pct(ours, 50), "otel_to_json_ms_per_run": pct(otel, 50)}


@contextlib.contextmanager
def both(tmp: Path, pin: bool = True):
    port = free_port()
    upstream = subprocess.Popen([sys.executable, str(Path(__file__).parent / "fake_upstream.py"),
                                 "--port", str(port), "--chunks", "20"])
    config = tmp / "flowlift.toml"
    config.write_text(CONFIG.format(url=f"http://127.0.0.1:{port}"))
    common = ("--engine", "fake", "--config", str(config), "--state-db", ":memory:",
              "--log-level", "warning")
    try:
        with running_proxy(*common, "--trace-dir", str(tmp / "traces"),
                           log_path=tmp / "traced.log") as (traced, p1):
            os.environ["OTEL_SDK_DISABLED"] = "true"
            try:
                cm = running_proxy(*common, log_path=tmp / "untraced.log")
                with cm as (untraced, p2):
                    os.environ.pop("OTEL_SDK_DISABLED", None)
                    if pin and (os.cpu_count() or 1) >= 2:
                        for pid in (p1.pid, p2.pid, upstream.pid):
                            os.sched_setaffinity(pid, {1})
                        os.sched_setaffinity(0, {0})
                    yield {"traced": (traced, p1.pid), "untraced": (untraced, p2.pid)}
            finally:
                os.environ.pop("OTEL_SDK_DISABLED", None)
    finally:
        upstream.terminate()
        upstream.wait(timeout=10)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--export-only", action="store_true",
                    help="only the in-process span building / serialising figures")
    ap.add_argument("--smoke", action="store_true",
                    help="5 requests, 2 runs, no core pinning, nothing saved")
    a = ap.parse_args()
    if a.smoke:
        a.requests, a.runs = 5, 2
    cost = export_cost(runs=5 if a.smoke else 50)
    print("per 24-step run: " + ", ".join(f"{k} {v:.2f}" for k, v in cost.items()))
    if a.export_only:
        return
    with tempfile.TemporaryDirectory() as d, both(Path(d), pin=not a.smoke) as servers:
        results: dict[str, Any] = {
            kind: await measure(servers, kind, a.runs if kind == "workflow" else a.requests
                                * (4 if kind.startswith("forward") else 1))
            for kind in KINDS}
        spans = Path(d, "traces", "spans.jsonl")
        await asyncio.sleep(6)  # the batch processor exports every 5 s
        results["spans_exported"] = (sum(1 for _ in spans.open()) if spans.exists() else 0)
    print(f"{'kind':<15} {'path':<9} {'p50 ms':>8} {'p99 ms':>8} {'cpu ms/req':>11}")
    for kind in KINDS:
        for path, r in results[kind].items():
            print(f"{kind:<15} {path:<9} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
                  f"{r['cpu_ms_per_request']:>11.2f}")
        t, u = results[kind]["traced"], results[kind]["untraced"]
        print(f"{kind:<15} {'ratio':<9} {t['p50_ms'] / u['p50_ms']:>8.2f} "
              f"{t['p99_ms'] / u['p99_ms']:>8.2f} "
              f"{t['cpu_ms_per_request'] / max(u['cpu_ms_per_request'], 1e-9):>11.2f}")
    print(f"spans exported by the traced proxy: {results['spans_exported']}")
    save("tracing_overhead", {"args": vars(a), "in_process": cost, **results}, smoke=a.smoke)


if __name__ == "__main__":
    asyncio.run(main())
