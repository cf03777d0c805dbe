"""Proxy overhead: what a proxy adds per request, side by side in one run.

Paths to one fast local fake OpenAI upstream (``bench/fake_upstream.py``, canned bytes):

1. ``direct``: client -> fake upstream;
2. ``bare``: a few-dozen-line aiohttp forwarder (``bench/bare_forwarder.py``), the floor
   a Python proxy can reach;
3. ``flowlift``: ``flowlift serve --config <generated bench/proxy_overhead.toml>``;
4. ``litellm``: LiteLLM's proxy from the benchmark's own venv (``bash
   bench/setup_litellm.sh`` -> ``bench/.venv-litellm``), ``bench/litellm_config.yaml``,
   started offline, one worker, access log off (``LITELLM_LOG=ERROR``).

Each mode (non-streaming JSON, and ``stream: true`` with 20 SSE chunks) is measured in
two phases:

* latency: sequential requests, one path after another in a rotating order (request
  ``i`` of every path runs back to back, so drift hits all paths alike) -> p50 / p99
  of end-to-end time (last byte read); "added" = path minus ``direct``. A path slower
  than ``--slow-ms`` in warm-up (LiteLLM) joins every k-th round only, ``--slow-requests``
  in all, so that the full run stays under ~5 minutes;
* throughput: ``--concurrency`` clients (32) in closed loop for ``--duration`` s per path,
  split into ``--rounds`` slots that alternate between paths -> requests/s.

Server CPU time per request: utime+stime from ``/proc/<pid>/stat`` of each server process
and its descendants, read before and after each phase (throughput phase: the proxy and
the fake upstream separately; latency phase: the proxy only, idle time included).

Pinning: this process (the load generator) runs on core 0; the fake upstream and every
proxy under test on core 1 (``os.sched_setaffinity``; needs >= 2 cores, else unpinned).

    .venv/bin/python bench/proxy_overhead.py            # full run, ~3-5 min
    .venv/bin/python bench/proxy_overhead.py --quick    # short run, ~30 s + LiteLLM start
    .venv/bin/python bench/proxy_overhead.py --smoke    # seconds, no LiteLLM, nothing saved
    .venv/bin/python bench/proxy_overhead.py --quick --paths bare,flowlift --profile cprofile
    # before/after in one run: main's flowlift (path baseline) beside this tree's
    .venv/bin/python bench/proxy_overhead.py --paths bare,bare_uvloop,baseline,flowlift \
        --baseline-pythonpath /path/to/a/shadow/of/main

Paths ``bare_uvloop`` (the forwarder on uvloop) and ``baseline`` (flowlift imported
from ``--baseline-pythonpath``) run only when named in ``--paths``.

Writes ``bench/results/proxy_overhead.json`` (``--quick``: ``$TMPDIR/proxy_overhead.quick.json``)
and prints a table. Server logs: ``bench/results/proxy_overhead.<path>.log``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp

from bench.harness import RESULTS, free_port, pct, save
from bench.profiling import (
    CPROFILE_OUT,
    CPROFILE_WRAPPER,
    PYSPY_OUT,
    start_pyspy,
    stop_pyspy,
    summarize_cprofile,
    summarize_pyspy,
)

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
PY = sys.executable
LITELLM_VENV = BENCH / ".venv-litellm"
MASTER_KEY = "sk-bench-overhead"
MODEL = "bench-model"
CLK_TCK = os.sysconf("SC_CLK_TCK")
LOADGEN_CORE, SERVER_CORE = 0, 1
PATHS = ("direct", "bare", "bare_uvloop", "baseline", "flowlift", "litellm")
DEFAULT_PATHS = ("direct", "bare", "flowlift", "litellm")
HEADERS = {"Authorization": f"Bearer {MASTER_KEY}", "Content-Type": "application/json"}


def _body(stream: bool) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": 32, "stream": stream,
                       "messages": [{"role": "user", "content": "Say hello."}]}).encode()


MODES = {"json": _body(False), "stream": _body(True)}


# --------------------------------------------------------------------------- CPU time

def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
    return out


def cpu_s(pid: int | None) -> float:
    """utime+stime of ``pid`` and all its live descendants, in seconds."""
    if pid is None:
        return 0.0
    ticks = 0
    for p in _descendants(pid):
        with contextlib.suppress(OSError):
            with open(f"/proc/{p}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
            ticks += int(rest[11]) + int(rest[12])  # fields 14, 15: utime, stime
    return ticks / CLK_TCK


def self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# --------------------------------------------------------------------------- servers

def _pin_server() -> None:
    if PINNED:
        os.sched_setaffinity(0, {SERVER_CORE})
    os.setsid()  # own process group: stopped as a group


PINNED = (os.cpu_count() or 1) >= 2


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes] | None = None
    base: str = ""                   # http://127.0.0.1:port (requests go to base + /v1/...)
    log: Path | None = None
    available: bool = False
    why: str | None = None
    version: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    log_dir: Path = RESULTS          # its log: proxy_overhead.<name>.log here

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.log = self.log_dir / f"proxy_overhead.{self.name}.log"
        out = self.log.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, **(env or {})},
                                     preexec_fn=_pin_server)
        out.close()
        self.extra["cmd"] = " ".join(c.replace(str(ROOT) + "/", "") for c in cmd)

    def log_tail(self, n: int = 1500) -> str:
        if self.log and self.log.exists():
            return self.log.read_text(errors="replace")[-n:]
        return ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


async def wait_ready(session: aiohttp.ClientSession, srv: Server, timeout_s: float) -> None:
    """Until a real chat completion through ``srv`` answers 200 (or ``srv`` dies)."""
    t0 = time.monotonic()
    last = ""
    while time.monotonic() - t0 < timeout_s:
        if srv.proc and srv.proc.poll() is not None:
            raise RuntimeError(f"exited with {srv.proc.returncode}: {srv.log_tail()}")
        try:
            async with session.post(srv.base + "/v1/chat/completions", data=MODES["json"],
                                    headers=HEADERS,
                                    timeout=aiohttp.ClientTimeout(total=10)) as r:
                body = await r.read()
                if r.status == 200 and b"chat.completion" in body:
                    srv.extra["ready_s"] = round(time.monotonic() - t0, 1)
                    return
                last = f"HTTP {r.status}: {body[:300]!r}"
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            last = repr(e)
        await asyncio.sleep(0.25)
    raise RuntimeError(f"not ready after {timeout_s:.0f} s (last: {last}); log: {srv.log_tail()}")


def flowlift_toml(upstream: str) -> str:
    src = (BENCH / "proxy_overhead.toml").read_text()
    return re.sub(r'base_url = "[^"]*"', f'base_url = "{upstream}/v1"', src)


def start_servers(tmp: Path, wanted: list[str], profile: str | None,
                  log_dir: Path = RESULTS, baseline: str | None = None) -> dict[str, Server]:
    """Starts every wanted server (not waiting for readiness); their logs go to
    ``log_dir``."""
    up = Server("upstream", log_dir=log_dir)
    port = free_port()
    up.start([PY, str(BENCH / "fake_upstream.py"), "--port", str(port), "--chunks", "20"])
    up.base = f"http://127.0.0.1:{port}"
    servers = {"upstream": up}

    direct = Server("direct", base=up.base, available=True)
    servers["direct"] = direct

    for name in ("bare", "bare_uvloop"):
        if name not in wanted:
            continue
        s = Server(name, log_dir=log_dir)
        port = free_port()
        s.start([PY, str(BENCH / "bare_forwarder.py"), "--upstream", up.base,
                 "--port", str(port), *(["--uvloop"] if name == "bare_uvloop" else [])])
        s.base = f"http://127.0.0.1:{port}"
        s.version = f"aiohttp {aiohttp.__version__}" + (" on uvloop" if "uvloop" in name else "")
        servers[name] = s

    for name in ("baseline", "flowlift"):
        if name not in wanted:
            continue
        s = Server(name, log_dir=log_dir)
        cfg = tmp / "proxy_overhead.toml"
        cfg.write_text(flowlift_toml(up.base))
        port = free_port()
        args = ["serve", "--config", str(cfg), "--port", str(port),
                "--state-db", ":memory:", "--log-level", "warning"]
        # baseline: the flowlift of another tree (its import path in --baseline-pythonpath)
        env = {"PYTHONPATH": baseline} if name == "baseline" and baseline else None
        if profile == "cprofile" and name == "flowlift":  # CPU-time profile, written at stop
            s.extra["profile_file"] = str(CPROFILE_OUT.relative_to(ROOT))
            s.start([PY, "-c", CPROFILE_WRAPPER, str(CPROFILE_OUT), *args])
        else:  # this interpreter's flowlift (a worktree has no .venv/bin/flowlift)
            s.start([PY, "-m", "flowlift.cli", *args], env=env)
        s.base = f"http://127.0.0.1:{port}"
        s.extra["config"] = cfg.read_text()
        if env is not None:
            s.extra["pythonpath"] = baseline
            s.version = f"flowlift from PYTHONPATH={baseline}"
            servers[name] = s
            continue
        with contextlib.suppress(Exception):
            from importlib.metadata import version
            git = ["git", "-C", str(ROOT)]
            head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True).stdout.strip()
            dirty = subprocess.run([*git, "status", "--porcelain", "--", "proxy", "src"],
                                   capture_output=True, text=True).stdout.strip()
            s.version = (f"flowlift {version('flowlift')} @ {head}"
                         + (" + uncommitted changes in proxy/ or src/" if dirty else ""))
        servers[name] = s

    if "litellm" in wanted:
        s = Server("litellm", log_dir=log_dir)
        exe = LITELLM_VENV / "bin" / "litellm"
        if not exe.exists():
            s.why = f"{exe} not found: run `bash bench/setup_litellm.sh` first"
        else:
            port = free_port()
            s.start([str(exe), "--config", str(BENCH / "litellm_config.yaml"),
                     "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"],
                    env={"LITELLM_MASTER_KEY": MASTER_KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                         "OPENAI_API_KEY": "sk-dummy", "FAKE_UPSTREAM_BASE": up.base + "/v1",
                         "LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False",
                         "NO_DOCS": "True", "DISABLE_ADMIN_UI": "True"})
            s.base = f"http://127.0.0.1:{port}"
            s.extra["setup"] = ("out of the box: `pip install 'litellm[proxy]'`, one uvicorn "
                                "worker, access log off (LITELLM_LOG=ERROR), no database")
            with contextlib.suppress(Exception):
                s.version = "litellm " + subprocess.run(
                    [str(LITELLM_VENV / "bin" / "python"), "-c",
                     "from importlib.metadata import version; print(version('litellm'))"],
                    capture_output=True, text=True, timeout=60).stdout.strip()
        servers["litellm"] = s
    return servers


# --------------------------------------------------------------------------- load

async def one_request(session: aiohttp.ClientSession, url: str, body: bytes,
                      stream: bool) -> tuple[float, float, bool]:
    """(end-to-end s, first-byte s, ok) of one chat completion."""
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers=HEADERS) as r:
        first = await r.content.readany()
        t1 = time.perf_counter()
        rest = await r.content.read()
        t2 = time.perf_counter()
        data = first + rest
        if stream:
            ok = r.status == 200 and data.rstrip().endswith(b"[DONE]")
        else:
            ok = r.status == 200 and data.rstrip().endswith(b"}")
    return t2 - t0, t1 - t0, ok


async def latency_phase(sessions: dict[str, aiohttp.ClientSession], servers: dict[str, Server],
                        paths: list[str], mode: str, n: int, warmup: int, slow_ms: float,
                        slow_n: int) -> dict[str, Any]:
    """Sequential requests, one path after another in a rotating order.

    A path whose warm-up mean exceeds ``slow_ms`` takes part in every k-th round only
    (``slow_n`` requests in all, spread evenly over the phase) to bound the run time.
    """
    body, stream = MODES[mode], mode == "stream"
    urls = {p: servers[p].base + "/v1/chat/completions" for p in paths}
    warm: dict[str, list[float]] = {p: [] for p in paths}
    probe = min(warmup, 30)  # warm-up rounds of every path; then slow paths rest
    for i in range(warmup):
        for p in paths:
            if i < probe or sum(warm[p]) / max(len(warm[p]), 1) * 1000 <= slow_ms:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                    warm[p].append((await one_request(sessions[p], urls[p], body, stream))[0])
    stride = {p: (max(1, -(-n // slow_n)) if sum(warm[p]) / max(len(warm[p]), 1) * 1000 > slow_ms
                  else 1) for p in paths}
    lat: dict[str, list[float]] = {p: [] for p in paths}
    ttfb: dict[str, list[float]] = {p: [] for p in paths}
    errors = dict.fromkeys(paths, 0)
    cpu0 = {p: cpu_s(servers[p].pid) for p in paths}
    t0 = time.monotonic()
    k = len(paths)
    for i in range(n):
        for j in range(k):  # rotating order
            p = paths[(i + j) % k]
            if i % stride[p]:
                continue
            try:
                e2e, fb, ok = await one_request(sessions[p], urls[p], body, stream)
            except (aiohttp.ClientError, TimeoutError, OSError):
                errors[p] += 1
                continue
            lat[p].append(e2e)
            ttfb[p].append(fb)
            errors[p] += not ok
    wall = time.monotonic() - t0
    out: dict[str, Any] = {}
    for p in paths:
        ms = [x * 1000 for x in lat[p]]
        out[p] = {"n": len(ms), "errors": errors[p],
                  "p50_ms": round(pct(ms, 50), 3), "p99_ms": round(pct(ms, 99), 3),
                  "mean_ms": round(sum(ms) / max(len(ms), 1), 3),
                  "first_byte_p50_ms": round(pct([x * 1000 for x in ttfb[p]], 50), 3)}
        if servers[p].pid is not None:
            out[p]["proxy_cpu_ms_per_req"] = round(
                (cpu_s(servers[p].pid) - cpu0[p]) * 1000 / max(len(ms), 1), 3)
    out["_wall_s"] = round(wall, 1)
    return out


async def throughput_slot(session: aiohttp.ClientSession, url: str, body: bytes, stream: bool,
                          concurrency: int, duration: float) -> tuple[int, int, float, list[float]]:
    done = errors = 0
    lats: list[float] = []
    deadline = time.perf_counter() + duration

    async def worker() -> None:
        nonlocal done, errors
        while time.perf_counter() < deadline:
            try:
                e2e, _, ok = await one_request(session, url, body, stream)
            except (TimeoutError, aiohttp.ClientError, OSError):
                e2e, ok = 0.0, False
            if ok:
                done += 1
                lats.append(e2e)
            else:
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, errors, time.perf_counter() - t0, lats


@dataclass
class _Acc:
    """One path's throughput slots, summed."""

    done: int = 0
    errors: int = 0
    wall: float = 0.0
    proxy_cpu: float = 0.0
    up_cpu: float = 0.0
    client_cpu: float = 0.0
    lats: list[float] = field(default_factory=list)


async def throughput_phase(sessions: dict[str, aiohttp.ClientSession],
                           servers: dict[str, Server], paths: list[str], mode: str,
                           concurrency: int, duration: float, rounds: int) -> dict[str, Any]:
    body, stream = MODES[mode], mode == "stream"
    up_pid = servers["upstream"].pid
    acc = {p: _Acc() for p in paths}
    for r in range(rounds):
        order = paths[r % len(paths):] + paths[:r % len(paths)]
        for p in order:
            a = acc[p]
            pid = servers[p].pid
            await throughput_slot(sessions[p], servers[p].base + "/v1/chat/completions", body,
                                  stream, concurrency, 0.2)  # reopen pooled connections
            c0, u0, s0 = cpu_s(pid), cpu_s(up_pid), self_cpu_s()
            done, errors, wall, lats = await throughput_slot(
                sessions[p], servers[p].base + "/v1/chat/completions", body, stream,
                concurrency, duration / rounds)
            a.proxy_cpu += cpu_s(pid) - c0
            a.up_cpu += cpu_s(up_pid) - u0
            a.client_cpu += self_cpu_s() - s0
            a.done += done
            a.errors += errors
            a.wall += wall
            a.lats += lats
    out: dict[str, Any] = {}
    for p in paths:
        a = acc[p]
        n = max(a.done, 1)
        ms = [x * 1000 for x in a.lats]
        out[p] = {"requests": a.done, "errors": a.errors, "wall_s": round(a.wall, 2),
                  "rps": round(a.done / a.wall, 1),
                  "p50_ms_under_load": round(pct(ms, 50), 2),
                  "p99_ms_under_load": round(pct(ms, 99), 2),
                  "upstream_cpu_ms_per_req": round(a.up_cpu * 1000 / n, 3),
                  "client_core_busy": round(a.client_cpu / a.wall, 2),
                  "server_core_busy": round((a.proxy_cpu + a.up_cpu) / a.wall, 2)}
        if servers[p].pid is not None:
            out[p]["proxy_cpu_ms_per_req"] = round(a.proxy_cpu * 1000 / n, 3)
    return out


# --------------------------------------------------------------------------- report

def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return round(a / b, 2)


def summarize(results: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    ratios: dict[str, Any] = {}
    for mode, res in results.items():
        lat, thr = res["latency"], res["throughput"]
        d50, d99 = lat["direct"]["p50_ms"], lat["direct"]["p99_ms"]
        for p in paths:
            if p != "direct":
                lat[p]["added_p50_ms"] = round(lat[p]["p50_ms"] - d50, 3)
                lat[p]["added_p99_ms"] = round(lat[p]["p99_ms"] - d99, 3)

        added = {p: lat[p].get("added_p50_ms") for p in paths}
        cpu = {p: thr[p].get("proxy_cpu_ms_per_req") for p in paths}
        ratios[mode] = {
            f"flowlift/{other}": {
                "added_latency_p50": _ratio(added.get("flowlift"), added.get(other)),
                "cpu_per_request": _ratio(cpu.get("flowlift"), cpu.get(other)),
            } for other in ("bare", "bare_uvloop", "baseline", "litellm") if other in paths}
    return ratios


def table(results: dict[str, Any], paths: list[str]) -> str:
    rows = [f"{'mode':6} {'path':11} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8} "
            f"{'req/s@32':>9} {'cpu ms/req':>10} {'(idle-incl)':>11} {'err':>4}"]
    for mode, res in results.items():
        for p in paths:
            lt, th = res["latency"][p], res["throughput"][p]
            add50 = lt.get("added_p50_ms")
            add99 = lt.get("added_p99_ms")
            cpu = th.get("proxy_cpu_ms_per_req")
            cpu_l = lt.get("proxy_cpu_ms_per_req")
            rows.append(
                f"{mode:6} {p:11} {lt['p50_ms']:8.3f} {lt['p99_ms']:8.3f} "
                f"{'' if add50 is None else f'{add50:8.3f}':>8} "
                f"{'' if add99 is None else f'{add99:8.3f}':>8} {th['rps']:9.1f} "
                f"{'' if cpu is None else f'{cpu:10.3f}':>10} "
                f"{'' if cpu_l is None else f'{cpu_l:11.3f}':>11} "
                f"{lt['errors'] + th['errors']:4d}")
    return "\n".join(rows)


# --------------------------------------------------------------------------- main

@contextlib.contextmanager
def running(wanted: list[str], profile: str | None, smoke: bool = False,
            baseline: str | None = None) -> Iterator[tuple[dict[str, Server], Path]]:
    tmp = Path(tempfile.mkdtemp(prefix="proxy_overhead."))
    servers: dict[str, Server] = {}
    try:
        servers = start_servers(tmp, wanted, profile, log_dir=tmp if smoke else RESULTS,
                                baseline=baseline)
        yield servers, tmp
    finally:
        for s in reversed(list(servers.values())):
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)


async def wait_all(servers: dict[str, Server], wanted: list[str], timeout_s: float) -> None:
    """Waits for every started server; a server that fails gets its reason in ``why``."""
    async with aiohttp.ClientSession() as probe:
        await wait_ready(probe, servers["upstream"], 30)
        servers["direct"].extra["upstream_pid"] = servers["upstream"].pid

        async def ready(s: Server) -> None:
            if s.why is not None:
                return
            try:
                await wait_ready(probe, s, timeout_s)
                s.available = True
            except Exception as e:  # recorded in the JSON, the other paths still run
                s.why = f"failed to start: {e}"[:3000]

        await asyncio.gather(*(ready(servers[p]) for p in wanted if p != "direct"))
    for p in wanted:
        s = servers[p]
        print(f"[{p}] " + (f"ready ({s.version or ''}, {s.extra.get('ready_s', 0)} s)"
                           if s.available else f"SKIPPED: {(s.why or '')[:400]}"), flush=True)


async def measure(a: argparse.Namespace, servers: dict[str, Server],
                  paths: list[str]) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=60)
    sessions = {p: aiohttp.ClientSession(
        # Idle connections are dropped by the client after 2 s, before a server drops
        # them (uvicorn, under LiteLLM: 5 s): a POST on a connection the server just
        # closed fails and is not retried.
        connector=aiohttp.TCPConnector(limit=a.concurrency, keepalive_timeout=2),
        timeout=timeout) for p in paths}
    results: dict[str, Any] = {}
    try:
        for mode in MODES:
            t0 = time.monotonic()
            lat = await latency_phase(sessions, servers, paths, mode, a.requests, a.warmup,
                                      a.slow_ms, a.slow_requests)
            print(f"[{mode}] latency phase: " + ", ".join(f"{p} {lat[p]['n']}" for p in paths)
                  + f" requests in {lat.pop('_wall_s')} s", flush=True)
            thr = await throughput_phase(sessions, servers, paths, mode, a.concurrency,
                                         a.duration, a.rounds)
            print(f"[{mode}] throughput phase done ({time.monotonic() - t0:.0f} s for mode)",
                  flush=True)
            results[mode] = {"latency": lat, "throughput": thr}
    finally:
        for session in sessions.values():
            await session.close()
    return results


_OVERHEAD_SAMPLE = re.compile(r'^flowlift_proxy_overhead_seconds_(sum|count)\{operation="chat",'
                              r'stream="(true|false)"\} (\S+)$', re.MULTILINE)


async def reported_overhead(srv: Server) -> dict[str, Any]:
    """What the proxy says its own overhead was over the whole run (its
    ``flowlift_proxy_overhead_seconds`` histogram): mean ms per request by mode, or
    ``{}`` where it has none (a tree before issue 18)."""
    async with aiohttp.ClientSession() as session, session.get(srv.base + "/metrics") as r:
        text = await r.text()
    got: dict[tuple[str, str], float] = {}
    for kind, stream, value in _OVERHEAD_SAMPLE.findall(text):
        got[(kind, stream)] = float(value)
    out: dict[str, Any] = {}
    for mode, stream in (("json", "false"), ("stream", "true")):
        n = got.get(("count", stream))
        if n:
            out[mode] = {"requests": int(n),
                         "mean_ms": round(got[("sum", stream)] / n * 1000, 3)}
    return out


async def bench(a: argparse.Namespace) -> dict[str, Any]:
    wanted = [p for p in PATHS if p in a.paths]
    t_start = time.monotonic()
    load0 = list(os.getloadavg())
    with running(wanted, a.profile, a.smoke, a.baseline_pythonpath) as (servers, _tmp):
        await wait_all(servers, wanted, a.ready_timeout)
        paths = [p for p in wanted if servers[p].available]
        if a.smoke and paths != wanted:  # a smoke run checks that every path still runs
            raise SystemExit("smoke: paths did not start: " + "; ".join(
                f"{p}: {servers[p].why}" for p in wanted if p not in paths))
        print(f"servers up after {time.monotonic() - t_start:.0f} s; pinning: "
              + (f"load generator on core {LOADGEN_CORE}, fake upstream + proxies on core "
                 f"{SERVER_CORE}" if PINNED else "none (fewer than 2 cores)"), flush=True)
        profiler = None
        if a.profile == "py-spy" and servers.get("flowlift") and servers["flowlift"].available:
            profiler = start_pyspy(servers["flowlift"].pid, LITELLM_VENV)
            if profiler is not None:
                servers["flowlift"].extra["profile_file"] = str(PYSPY_OUT.relative_to(ROOT))
        try:
            results = await measure(a, servers, paths)
            reported = {p: await reported_overhead(servers[p]) for p in paths
                        if p in ("baseline", "flowlift")}
        finally:
            if profiler is not None:
                stop_pyspy(profiler)
    profile = None  # written once the servers have stopped (cProfile: at exit)
    if a.profile == "py-spy" and PYSPY_OUT.exists():
        profile = summarize_pyspy(PYSPY_OUT)
    elif a.profile == "cprofile" and CPROFILE_OUT.exists():
        profile = summarize_cprofile(CPROFILE_OUT)
    if profile:
        print(f"\nflowlift profile ({a.profile}, {profile['what']}):")
        for row in profile["top"][:25]:
            print(f"  {row}")
        if "self_time_by_package" in profile:
            print("  self time by package:", profile["self_time_by_package"])

    ratios = summarize(results, paths)
    print()
    print(table(results, paths))
    for p, by_mode in reported.items():
        print(f"{p}: its own overhead as it reports it (flowlift_proxy_overhead_seconds, "
              "whole run): " + ("; ".join(f"{m} mean {v['mean_ms']} ms over {v['requests']}"
                                          for m, v in by_mode.items()) or "not reported"))
    print("\n(+p50/+p99: added over direct; cpu ms/req: proxy process tree, throughput "
          "phase; idle-incl: latency phase, idle time included)")
    for mode, r in ratios.items():
        print(f"{mode}: " + "; ".join(
            f"{k} added p50 x{v['added_latency_p50']}, cpu/req x{v['cpu_per_request']}"
            for k, v in r.items()))
    return {
        "command": "python bench/proxy_overhead.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_at_start": load0, "loadavg_at_end": list(os.getloadavg()),
                    "note": "shared machine: other work ran beside this benchmark; compare "
                            "paths within one run (interleaved), not across runs",
                    "platform": platform.platform(),
                    "pinning": (f"load generator (this process, one asyncio loop + uvloop "
                                f"when installed) on core {LOADGEN_CORE}; fake upstream and "
                                f"the proxy under test on core {SERVER_CORE}") if PINNED
                    else "none: fewer than 2 cores"},
        "config": {"requests": a.requests, "warmup": a.warmup, "slow_ms": a.slow_ms,
                   "slow_requests": a.slow_requests, "concurrency": a.concurrency,
                   "duration_s_per_path": a.duration, "rounds": a.rounds,
                   "stream_chunks": 20,
                   "stream_writes": "one write (own TCP segment) per SSE event, back to back",
                   "client": f"aiohttp {aiohttp.__version__} "
                   "ClientSession, TCPConnector(limit=concurrency), keep-alive",
                   "latency_phase": "sequential, paths in rotating order per request; a "
                   "path slower than slow_ms in warm-up runs every k-th round only "
                   "(slow_requests in all)",
                   "throughput_phase": "closed loop, slots alternating between paths",
                   "cpu": "utime+stime of the server's process tree from /proc/<pid>/stat "
                          f"(tick {1000 / CLK_TCK:.0f} ms)"},
        "paths": {p: {"available": servers[p].available, "why": servers[p].why,
                      "version": servers[p].version,
                      **{k: v for k, v in servers[p].extra.items() if k != "config"}}
                  for p in wanted},
        "results": results,
        "ratios": ratios,
        "reported_overhead": reported,
        "profile": profile,
        "total_s": round(time.monotonic() - t_start, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short run (~30 s)")
    p.add_argument("--smoke", action="store_true",
                   help="seconds: direct,bare,flowlift only, a few requests, nothing saved "
                   "(tests/project/test_bench_smoke.py runs it)")
    p.add_argument("--requests", type=int, help="sequential requests per path and mode")
    p.add_argument("--warmup", type=int, help="warm-up requests per path and mode")
    p.add_argument("--slow-ms", type=float, default=20.0,
                   help="a path slower than this (warm-up mean) is sampled less often")
    p.add_argument("--slow-requests", type=int,
                   help="sequential requests of such a slow path (spread evenly)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, help="throughput seconds per path and mode")
    p.add_argument("--rounds", type=int, help="throughput slots per path (alternating)")
    p.add_argument("--paths", default=",".join(DEFAULT_PATHS),
                   help="comma-separated subset of " + ",".join(PATHS))
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--baseline-pythonpath",
                   help="with path `baseline`: the PYTHONPATH its flowlift is imported from "
                   "(another tree, e.g. a shadow package of main made by a checkout of it), "
                   "to measure before and after side by side in one run")
    p.add_argument("--profile", choices=("py-spy", "cprofile"),
                   help="profile flowlift during the run (py-spy: sampling, wall-clock; "
                   "cprofile: deterministic, CPU time); numbers of such a run are skewed, "
                   "so its JSON goes to the temp dir")
    p.add_argument("--out", help="results name in bench/results (default: proxy_overhead; "
                   "--quick: a file in the temp dir, not under bench/results)")
    a = p.parse_args()
    if a.smoke:
        a.quick, a.paths, a.profile, a.out = True, "direct,bare,flowlift", None, None
        a.requests, a.warmup, a.duration, a.slow_requests = 20, 5, 0.3, 10
    q = a.quick
    a.requests = a.requests or (150 if q else 2000)
    a.warmup = a.warmup if a.warmup is not None else (20 if q else 200)
    a.duration = a.duration or (1.0 if q else 8.0)
    a.rounds = a.rounds or (1 if q else 2)
    a.slow_requests = a.slow_requests or (60 if q else 400)
    a.paths = ["direct", *(x for x in a.paths.split(",") if x in PATHS and x != "direct")]
    if PINNED:
        os.sched_setaffinity(0, {LOADGEN_CORE})
    if not a.smoke:
        RESULTS.mkdir(parents=True, exist_ok=True)
    try:
        import uvloop
        data = uvloop.run(bench(a))
    except ImportError:
        data = asyncio.run(bench(a))
    if a.smoke:
        print("smoke: proxy_overhead results not saved")
    elif (q or a.profile) and not a.out:
        path = Path(tempfile.gettempdir()) / (
            "proxy_overhead." + ("profile" if a.profile else "quick") + ".json")
        path.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S"), **data},
                                   indent=2))
        print(f"results (not kept): {path}")
    else:
        save(a.out or "proxy_overhead", data)


if __name__ == "__main__":
    main()
