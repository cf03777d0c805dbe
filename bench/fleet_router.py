"""Agent sessions through flowlift -> vllm-router -> two vLLM servers, against the same
sessions sent to vllm-router directly (issue 37 item 6), side by side in one run.

The fleet: two stock vLLM servers (``python -m vllm.entrypoints.openai.api_server``,
the CPU build, the default model, prefix caching on, ``--enable-prompt-tokens-details``
so each answer reports its cached tokens) behind one vllm-router 0.1.17
(``--policy consistent_hash --enable-program-scheduling``). Two arms, the same router:

* ``flowlift``: each session's turns go through ``flowlift serve --engine none`` with
  ``X-Flowlift-Session``; the backend opts in to ``vllm-session`` and
  ``vllm-router-program`` (the router sees ``x-session-id`` and
  ``vllm_xargs.agentic_context``);
* ``direct``: the same turns sent to the router as a plain OpenAI client would, without
  flowlift's fields (the router hashes what it has: the body);
* ``direct_session``: the same turns sent to the router by a client that sets the
  router's own ``X-Session-ID`` header itself (what a user who read the router's docs
  would run instead of flowlift: stickiness without program scheduling).

A session is an agent loop of ``--turns`` turns: a session-specific context of
``--context-chars`` characters, then per turn the model's answer (``--max-tokens``) and a
tool result of ``--tool-chars`` characters appended, ``--think-s`` seconds between turns
(the tool). All ``--sessions`` sessions start together. Each arm-round gets its own
contexts (a salt), so no arm reuses another's cache. Rounds alternate the arm order.

Reported per arm: session completion time (first turn sent to last answer) p50, p90,
mean; the share of later turns' prompt tokens served from a prefix cache (reported
``cached_tokens``); requests per vLLM server (their ``/metrics`` counters); sessions
whose turns stayed on one server (a later turn with no cached tokens = moved).

    .venv/bin/python bench/fleet_router.py            # ~10 min on 2 CPU cores
    .venv/bin/python bench/fleet_router.py --smoke    # fake upstreams, seconds

Writes ``bench/results/fleet_router.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS, ROOT, free_port, pct, proxy, save

PY = sys.executable
MODEL = "smol"


def _wait(url: str, timeout_s: float, proc: subprocess.Popen[bytes], name: str) -> None:
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"{name} not ready at {url} after {timeout_s} s")


LOGS = [RESULTS]  # where the servers' logs go (a temporary folder for --smoke)


@contextlib.contextmanager
def started(args: list[str], name: str, ready: str, timeout_s: float,
            env: dict[str, str] | None = None) -> Iterator[None]:
    LOGS[0].mkdir(parents=True, exist_ok=True)
    with open(LOGS[0] / f"fleet_router.{name}.log", "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
        try:
            t0 = time.monotonic()
            _wait(ready, timeout_s, proc, name)
            print(f"[{name}] ready in {time.monotonic() - t0:.0f} s", flush=True)
            yield
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def vllm_server(port: int, model_dir: Path, name: str) -> contextlib.AbstractContextManager[None]:
    cache = ROOT / ".cache" / "flowlift"
    # one OpenMP thread each, unbound (two servers on a 2-core machine; vLLM's auto
    # binding would give each server every core), as bench/peers runs its servers
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "3600",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CACHE_ROOT": str(cache / "vllm"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "torchinductor")}
    args = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "4096", "--enforce-eager", "--dtype", "float32",
            "--enable-prompt-tokens-details"]
    return started(args, name, f"http://127.0.0.1:{port}/health", 600, env)


def fake_server(port: int, name: str) -> contextlib.AbstractContextManager[None]:
    args = [PY, str(ROOT / "bench" / "fake_upstream.py"), "--port", str(port)]
    return started(args, name, f"http://127.0.0.1:{port}/v1/models", 60)


def router(port: int, workers: list[str]) -> contextlib.AbstractContextManager[None]:
    args = [PY, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port",
            str(port), "--policy", "consistent_hash", "--enable-program-scheduling",
            "--log-level", "warning", "--worker-urls", *workers]
    return started(args, "router", f"http://127.0.0.1:{port}/health", 120)


def served(url: str) -> float:
    """Requests a vLLM server finished (its ``vllm:request_success_total``)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(m) for m in re.findall(
        r'^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$', text, re.M))


async def session(client: httpx.AsyncClient, url: str, sid: str, salt: str,
                  args: argparse.Namespace, headers: dict[str, str]) -> dict[str, Any]:
    words = f"{salt} {sid} " + " ".join(f"w{(hash((salt, sid, i)) % 997)}"
                                        for i in range(args.context_chars // 5))
    convo: list[dict[str, str]] = [{"role": "system", "content": words},
                                   {"role": "user", "content": "Start the task."}]
    t0 = time.monotonic()
    cached: list[tuple[int, int]] = []
    for turn in range(args.turns):
        resp = await client.post(url, headers=headers, json={
            "model": MODEL, "messages": convo, "max_tokens": args.max_tokens,
            "temperature": 0.0})
        resp.raise_for_status()
        doc = resp.json()
        usage = doc.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        cached.append((int(usage.get("prompt_tokens", 0)),
                       int(details.get("cached_tokens") or 0)))
        answer = doc["choices"][0]["message"]["content"] or ""
        if turn + 1 < args.turns:
            await asyncio.sleep(args.think_s)
            convo = [*convo, {"role": "assistant", "content": answer},
                     {"role": "user", "content": f"tool result {turn}: " + "r" * args.tool_chars}]
    return {"session": sid, "completion_s": time.monotonic() - t0, "turns": cached}


def _headers(arm: str, session_id: str) -> dict[str, str]:
    """What each arm's client sends besides the body: flowlift's session header, the
    router's own session header, or nothing."""
    if arm == "flowlift":
        return {"X-Flowlift-Session": session_id}
    if arm == "direct_session":
        return {"X-Session-ID": session_id}
    return {}


async def arm(name: str, url: str, salt: str, args: argparse.Namespace,
              servers: list[str]) -> dict[str, Any]:
    before = [served(s) for s in servers] if not args.smoke else [0.0] * len(servers)
    async with httpx.AsyncClient(timeout=600) as client:
        results = await asyncio.gather(*(
            session(client, url, f"s{i}", salt, args, _headers(name, f"{salt}-s{i}"))
            for i in range(args.sessions)))
    after = [served(s) for s in servers] if not args.smoke else [0.0] * len(servers)
    times = [r["completion_s"] for r in results]
    later = [t for r in results for t in r["turns"][1:]]
    moved = sum(1 for r in results if any(c == 0 for _, c in r["turns"][1:]))
    return {"arm": name, "salt": salt, "sessions": results,
            "completion_p50_s": pct(times, 50), "completion_p90_s": pct(times, 90),
            "completion_mean_s": sum(times) / len(times),
            "later_turn_cached_share": (sum(c for _, c in later)
                                        / max(sum(p for p, _ in later), 1)),
            "sessions_moved": moved,
            "requests_per_server": [round(a - b) for a, b in zip(after, before, strict=True)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--context-chars", type=int, default=2400)
    parser.add_argument("--tool-chars", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--think-s", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--arms", nargs="+", default=["flowlift", "direct"],
                        choices=["flowlift", "direct", "direct_session"])
    parser.add_argument("--out", default="fleet_router",
                        help="results file name under bench/results/ (no .json)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    # a SIGTERM (a timeout) unwinds the stack, so every server started is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.smoke:
        args.sessions, args.turns, args.rounds, args.think_s = 3, 2, 1, 0.0
        args.arms = ["flowlift", "direct", "direct_session"]
    from flowlift.local_engine.models import ensure_default_model

    ports = [free_port() for _ in range(3)]
    servers = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    with contextlib.ExitStack() as stack:
        if args.smoke:
            LOGS[0] = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for i, port in enumerate(ports[:2]):
            stack.enter_context(fake_server(port, f"vllm{i}") if args.smoke
                                else vllm_server(port, ensure_default_model("float32"),
                                                 f"vllm{i}"))
        stack.enter_context(router(ports[2], servers))
        cfg = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "fleet.toml"
        cfg.write_text(f"""
[backends.fleet]
kind = "openai"
base_url = "http://127.0.0.1:{ports[2]}/v1"
first_token_timeout_s = 600
hints = ["vllm-session", "vllm-router-program"]

[models.{MODEL}]
backends = ["fleet"]
total_timeout_s = 900
""")
        base = stack.enter_context(proxy("--engine", "none", "--config", str(cfg),
                                         name="fleet_router.flowlift",
                                         engine="fake" if args.smoke else "vllm"))
        direct = f"http://127.0.0.1:{ports[2]}/v1/chat/completions"
        urls = {"flowlift": f"{base}/v1/chat/completions", "direct": direct,
                "direct_session": direct}
        runs = []
        for r in range(args.rounds):
            shift = r % len(args.arms)  # rounds rotate which arm goes first
            for name in args.arms[shift:] + args.arms[:shift]:
                t0 = time.monotonic()
                out = asyncio.run(arm(name, urls[name], f"r{r}-{name}", args, servers))
                print(f"[round {r}] {name}: p50 {out['completion_p50_s']:.1f} s, "
                      f"p90 {out['completion_p90_s']:.1f} s, cached share of later turns "
                      f"{out['later_turn_cached_share']:.2f}, moved {out['sessions_moved']}"
                      f"/{args.sessions}, per server {out['requests_per_server']} "
                      f"({time.monotonic() - t0:.0f} s)", flush=True)
                runs.append({"round": r, **out})
    save(args.out, {"args": vars(args), "runs": runs}, smoke=args.smoke)


if __name__ == "__main__":
    main()
