"""The GPU smoke checks behind scripts/gpu_smoke.sh, each printed as one line
``[PASS|FAIL|INFO] check: detail``.

    .venv/bin/python scripts/gpu_smoke.py            # on a machine with an NVIDIA GPU
    .venv/bin/python scripts/gpu_smoke.py --cpu-dry  # the same flow on the fake engine

Three proxies (``flowlift serve``), as a user would start them:

A. two models at once (the default model and a hard-linked twin under another name), at
   ``--max-concurrency 16``: platform and planned settings; the engine smoke (8 JSON-
   schema requests, prefix-cache hits, the attention backend vLLM logged); both models
   served and ``/readyz`` 200; 64 streams (tokens/s, TTFT p50/p99, proxy CPU%).
B. the two models under a ``--memory-budget-mb`` that holds one: swaps M2 -> M -> M2 with
   the load/unload counts from ``/readyz`` and the worst ``/healthz`` delay meanwhile.
C. ``--max-concurrency 64``: 64 streams again, then ``kill -9`` of the proxy and a look
   for any process of it left (``nvidia-smi --query-compute-apps`` on a GPU).

``--cpu-dry`` runs the same checks on ``--engine fake --fake-core-process`` (an engine
core child spawned as vLLM's is) with a simulated 80 GiB H100 for the planned settings:
the flow is checked here, the GPU is not. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
OUTCOMES: list[bool | None] = []


def say(check: str, ok: bool | None, detail: str) -> None:
    """Print one check's line (``ok``: None for figures only)."""
    mark = {True: "PASS", False: "FAIL", None: "INFO"}[ok]
    print(f"[{mark}] {check}: {detail}", flush=True)
    OUTCOMES.append(ok)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, timeout_s: float = 5.0) -> tuple[int, dict[str, Any], float]:
    """``(status, JSON body, seconds)`` of a GET (status 0: no answer)."""
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except OSError:
        return 0, {}, time.perf_counter() - started
    try:
        body = json.loads(raw)
    except ValueError:
        body = {}
    return status, body, time.perf_counter() - started


class Proxy:
    """A ``flowlift serve`` process with its log in ``log``."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "flowlift", "serve", "--port", str(self.port),
               "--state-db", ":memory:", "--log-level", "info", *args]
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     cwd=ROOT)

    def wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if get(f"{self.base}/readyz")[0] == 200:
                return True
            time.sleep(0.5)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextmanager
def proxy(args: list[str], log: Path, timeout_s: float) -> Iterator[Proxy | None]:
    p = Proxy(args, log)
    try:
        ready = p.wait_ready(timeout_s)
        if not ready:
            tail = log.read_text()[-600:] if log.exists() else ""
            say("proxy start", False, f"not ready in {timeout_s:.0f} s: {tail}")
        yield p if ready else None
    finally:
        p.stop()


async def chat(session: aiohttp.ClientSession, base: str, model: str, content: str, *,
               max_tokens: int = 32, schema: dict[str, Any] | None = None,
               stream: bool = False) -> dict[str, Any]:
    """One chat completion: ``{"ok", "text", "usage", "ttft_s"}``."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                            "messages": [{"role": "user", "content": content}]}
    if schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "t", "schema": schema}}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    started = time.perf_counter()
    async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
        if not stream:
            data = await resp.json()
            text = (data.get("choices") or [{}])[0].get("message", {}).get("content") or ""
            return {"ok": resp.status == 200, "text": text, "usage": data.get("usage") or {},
                    "ttft_s": time.perf_counter() - started}
        ttft, text, usage = None, "", {}
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - started
                text += piece
        return {"ok": resp.status == 200, "text": text, "usage": usage,
                "ttft_s": ttft if ttft is not None else time.perf_counter() - started}


TICKET = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                           "urgent": {"type": "boolean"}},
          "required": ["title", "urgent"], "additionalProperties": False}
PREFIX = " ".join(f"Rule {i}: answer politely and cite policy section {i}." for i in range(40))


async def engine_smoke(p: Proxy, model: str) -> None:
    async with aiohttp.ClientSession() as s:
        outs = await asyncio.gather(*(chat(s, p.base, model, f"Ticket {i}: the app crashes",
                                           max_tokens=64, schema=TICKET) for i in range(8)))
        valid = 0
        for out in outs:
            with suppress(ValueError):
                valid += isinstance(json.loads(out["text"]), dict)
        say("engine: constrained JSON", valid == 8, f"{valid}/8 valid")
        await chat(s, p.base, model, PREFIX + " Question 0?", max_tokens=8)
        later = await asyncio.gather(*(chat(s, p.base, model, PREFIX + f" Question {i}?",
                                            max_tokens=8) for i in range(1, 8)))
        cached = sum((o["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                     for o in later)
        say("engine: prefix cache", cached > 0, f"{cached} cached prompt tokens over 7 "
            "requests sharing a prefix")
    backends = sorted(set(re.findall(r"[Uu]sing ([A-Za-z_.]+) (?:attention )?backend",
                                     p.log.read_text())))
    say("engine: attention backend", None, ", ".join(backends) or "none logged")


async def both_served(p: Proxy, models: list[str]) -> None:
    status, body, _ = get(f"{p.base}/readyz")
    async with aiohttp.ClientSession() as s:
        outs = await asyncio.gather(*(chat(s, p.base, m, "Say hi", max_tokens=8)
                                      for m in models))
    ok = status == 200 and all(o["ok"] for o in outs)
    say("two models at once", ok, f"/readyz {status}, models {body.get('models')}, "
        f"answers {[o['ok'] for o in outs]}")


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def streams(p: Proxy, model: str, cap: int, n: int = 64) -> None:
    cpu0, t0 = proc_cpu_s(p.proc.pid), time.perf_counter()
    async with aiohttp.ClientSession() as s:
        outs = await asyncio.gather(*(chat(s, p.base, model, f"Write a story about {i}.",
                                           max_tokens=64, stream=True) for i in range(n)))
    wall = time.perf_counter() - t0
    cpu = (proc_cpu_s(p.proc.pid) - cpu0) / wall * 100
    tokens = sum(o["usage"].get("completion_tokens") or 0 for o in outs)
    ttft = sorted(o["ttft_s"] * 1000 for o in outs)
    p99 = ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))]
    ok = all(o["ok"] for o in outs)
    say(f"{n} streams at --max-concurrency {cap}", ok,
        f"{sum(o['ok'] for o in outs)}/{n} ok, {tokens / wall:.0f} tokens/s, TTFT p50 "
        f"{statistics.median(ttft):.0f} ms p99 {p99:.0f} ms, proxy CPU {cpu:.0f}%")


async def swaps(p: Proxy, m: str, m2: str) -> None:
    worst = 0.0
    done = asyncio.Event()

    async def watch() -> None:
        nonlocal worst
        while not done.is_set():
            worst = max(worst, (await asyncio.to_thread(get, f"{p.base}/healthz"))[2])
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    answers = []
    async with aiohttp.ClientSession() as s:
        for model in (m2, m, m2):
            started = time.perf_counter()
            out = await chat(s, p.base, model, "Say hi", max_tokens=8)
            answers.append((model, out["ok"], round(time.perf_counter() - started, 2)))
    done.set()
    await watcher
    res = get(f"{p.base}/readyz")[1].get("residency") or {}
    loads, unloads = res.get("loads", {}), res.get("unloads", {})
    ok = all(a[1] for a in answers) and loads.get(m2, 0) >= 2 and unloads.get(m, 0) >= 1
    say("swaps M2 -> M -> M2", ok, f"requests (model, ok, s) {answers}; loads {loads}, "
        f"unloads {unloads}; worst /healthz {worst * 1000:.0f} ms")


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            kids = (task / "children")
            for child in (kids.read_text().split() if kids.exists() else ()):
                found.add(int(child))
                todo.append(int(child))
    return found


def gpu_apps() -> list[str]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader"], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if line.strip()]


def kill9(p: Proxy, gpu: bool) -> None:
    kids = descendants(p.proc.pid)
    p.proc.send_signal(signal.SIGKILL)
    p.proc.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(Path(f"/proc/{k}").exists() for k in kids):
        time.sleep(0.2)
    left = sorted(k for k in kids if Path(f"/proc/{k}/stat").exists()
                  and Path(f"/proc/{k}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z")
    apps = gpu_apps() if gpu else []
    say("kill -9: no process left", not left and not apps and bool(kids),
        f"{len(kids)} child process(es) before, {len(left)} left {left}; "
        + (f"nvidia-smi compute apps: {apps or 'none'}" if gpu else "no GPU (cpu-dry)"))


def platform_line(dry: bool) -> bool:
    from flowlift.local_engine.engine_settings import GiB, PlatformInfo, detect_platform
    from flowlift.local_engine.engine_settings import engine_settings as settings

    where = PlatformInfo("cuda", 80 * GiB, "simulated H100 (cpu-dry)") if dry \
        else detect_platform()
    s = settings(where, max_concurrency=16)
    say("platform", where.is_cuda, f"{where.kind} {where.device_name} "
        f"{where.total_memory_bytes / GiB:.0f} GiB; engine settings: dtype {s.dtype}, "
        f"CUDA graphs {not s.enforce_eager}, max_num_seqs {s.max_num_seqs}, sleep mode "
        f"{s.enable_sleep_mode}, start {s.multiproc_method}")
    return where.is_cuda


def models(dry: bool, work: Path) -> tuple[list[str], str, str, float]:
    """Engine arguments, M, M2 and the budget (MB) that holds one of them."""
    if dry:
        return (["--engine", "fake", "--model", "M", "--fake-core-process",
                 "--fake-delay-s", "0.005"], "M", "M2", 1536.0)
    from flowlift.local_engine.engine_plan import plan_engines
    from flowlift.local_engine.engine_settings import detect_platform
    from flowlift.local_engine.gpu_memory import MiB, headroom_bytes
    from flowlift.local_engine.models import DEFAULT_MODEL, ensure_default_model

    twin = work / "SmolLM2-twin"
    shutil.copytree(ensure_default_model("bfloat16"), twin, copy_function=os.link)
    total = detect_platform().total_memory_bytes
    usable_mb = (total - headroom_bytes(total, 1)) / MiB
    [one] = plan_engines([None], max_concurrency=16, budget_mb=usable_mb)
    return (["--model", DEFAULT_MODEL], DEFAULT_MODEL, str(twin), one.memory_mb * 1.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-dry", action="store_true",
                        help="the same flow on the fake engine, no GPU")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    args = parser.parse_args()
    dry = args.cpu_dry
    gpu = platform_line(dry) and not dry
    work = Path(tempfile.mkdtemp(prefix="gpu-smoke-"))
    engine, m, m2_arg, budget = models(dry, work)
    m2 = Path(m2_arg).name
    wait = args.ready_timeout_s
    try:
        with proxy([*engine, "--extra-model", m2_arg], work / "a.log", wait) as a:
            if a is not None:
                asyncio.run(engine_smoke(a, m))
                asyncio.run(both_served(a, [m, m2]))
                asyncio.run(streams(a, m, 16))
        with proxy([*engine, "--extra-model", m2_arg, "--memory-budget-mb", f"{budget:.0f}"],
                   work / "b.log", wait) as b:
            if b is not None:
                asyncio.run(swaps(b, m, m2))
        with proxy([*engine, "--max-concurrency", "64"], work / "c.log", wait) as c:
            if c is not None:
                asyncio.run(streams(c, m, 64))
                kill9(c, gpu)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    failed = OUTCOMES.count(False)
    print(f"gpu_smoke: {OUTCOMES.count(True)} passed, {failed} failed"
          + (" (cpu-dry: the flow on the fake engine; nothing ran on a GPU)" if dry else ""))
    return 1 if failed or (not dry and not gpu) else 0


if __name__ == "__main__":
    sys.exit(main())
