"""The soak (issue 16 item 10, issue 28 item 4): paced workflows with unique ids against a
``flowlift serve`` process, judged plateau or slope.

Run from the repository root (the 30-minute soak; ``tests/reliability/test_soak.py``
runs a 2-minute one in CI)::

    .venv/bin/python tests/reliability/soak_long.py --minutes 30 --out soak.json

The proxy is its own process (``tests/reliability/soak_serve.py``: ``flowlift serve
--engine fake`` with ``fake-model`` embedded, ``up`` on a fake OpenAI upstream in this
process, three tenants, a SQLite run store on disk), so its RSS and open file descriptors
are read from ``/proc/<pid>`` alone. Arrivals come at ``--rate`` a minute (open loop:
each at its scheduled time, whatever is still running), each a workflow run with an id
never used before -- streamed over SSE to its end, a fifth of them cancelled mid-run, a
fifth left early by their client and followed again, a tenth open runs -- and a chat
beside it (``soak_traffic.py`` has the mix).

Every ``--sample-s`` (5) it reads the proxy's RSS, fds and open runs
(``flowlift_active_workflows``); every ``--window-s`` (300) it prints a window: the
achieved rate, runs started and ended, errors, latency p50/p99 (time to a run's first
event, whole run, chat), the proxy's live objects and tables (``/soak/tables``). At the
end: the windows as a table, the slopes fitted after ``--warmup-s`` (a third of the run)
and the verdict (``soak_verdict.py``); ``--out`` writes it all as JSON. Exit 1 on a slope
or any error.

``--bound N`` bounds the proxy's tables at N (default 0: ``flowlift serve``'s own
bounds, 1,024 finished runs and 10,000 of the rest: they fill in about ten minutes at
1,000 arrivals a minute, the sessions with ``--max-sessions 5000``, since half the chats
make one). ``--leak runs|fds`` makes the proxy leak on purpose: the soak
must then fail.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: `tests` importable from the repo root
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from aiohttp import web  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from flowlift.testing import free_port  # noqa: E402
from tests.reliability.soak_traffic import TENANT_KEYS, Tally, arrival, upstream_answer  # noqa: E402
from tests.reliability.soak_verdict import slopes, table, verdict  # noqa: E402
from tests.upstream_fake import FakeUpstream  # noqa: E402


@dataclass(frozen=True)
class Options:
    """The soak's settings (the command line's flags, in seconds and per minute)."""

    minutes: float = 30.0
    rate_per_min: float = 1000.0
    window_s: float = 300.0
    sample_s: float = 5.0
    warmup_s: float | None = None
    """None: a third of the run."""
    bound: int = 0
    max_sessions: int | None = None
    """``flowlift serve --max-sessions`` (None: its default, 10,000)."""
    leak: str | None = None
    op_timeout_s: float = 60.0
    fake_delay_s: float = 0.02
    argv: list[str] = field(default_factory=list)


def write_config(folder: Path, up_url: str) -> Path:
    """The proxy's config: ``up`` on the fake upstream, three tenants."""
    tenants = "".join(f'[tenants.t{k}]\napi_key_env = "SOAK_KEYS_T{k}"\nmax_active_runs = 512\n'
                      "requests_per_s = 100000.0\nburst = 100000\n\n"
                      for k in range(len(TENANT_KEYS)))
    path = folder / "soak.toml"
    path.write_text(f'[backends.b0]\nkind = "openai"\nbase_url = "{up_url}/v1"\n\n'
                    f'[models.up]\nbackends = ["b0"]\n\n{tenants}')
    return path


async def start_upstream() -> tuple[web.AppRunner, str]:
    fake = FakeUpstream([upstream_answer])
    fake.received = deque(maxlen=64)  # type: ignore[assignment]  # the double's own log
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def start_proxy(folder: Path, up_url: str, port: int, opts: Options) -> subprocess.Popen[bytes]:
    """``soak_serve`` (``flowlift serve``) on ``port``; its log in ``folder/proxy.log``."""
    cmd = [sys.executable, "-m", "tests.reliability.soak_serve", "--bound", str(opts.bound),
           *(["--leak", opts.leak] if opts.leak else []), "--",
           "serve", "--engine", "fake", "--fake-delay-s", str(opts.fake_delay_s),
           "--max-concurrency", "32", "--port", str(port), "--log-level", "warning",
           "--config", str(write_config(folder, up_url)),
           "--state-db", str(folder / "state.sqlite"),
           *(["--max-sessions", str(opts.max_sessions)] if opts.max_sessions else [])]
    env = {**os.environ, **{f"SOAK_KEYS_T{k}": key for k, key in enumerate(TENANT_KEYS)}}
    with (folder / "proxy.log").open("ab") as log:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


async def wait_ready(client: httpx.AsyncClient, proc: subprocess.Popen[bytes],
                     log: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the proxy exited ({proc.returncode}): "
                               f"{log.read_text(errors='replace')[-3000:]}")
        try:
            if (await client.get("/readyz")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the proxy was not ready in {timeout_s:g} s: "
                       f"{log.read_text(errors='replace')[-3000:]}")


def proc_figures(pid: int) -> tuple[float, int, float]:
    """(RSS in MiB, open file descriptors, CPU seconds so far) of process ``pid`` (Linux
    ``/proc``: ``status``, ``fd``, ``stat``'s utime + stime)."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    with open(f"/proc/{pid}/stat") as f:
        ticks = f.read().rsplit(")", 1)[1].split()
    cpu_s = (int(ticks[11]) + int(ticks[12])) / os.sysconf("SC_CLK_TCK")
    return rss, len(os.listdir(f"/proc/{pid}/fd")), cpu_s


async def open_runs(client: httpx.AsyncClient) -> float:
    """``flowlift_active_workflows`` from the proxy's ``/metrics``."""
    text = (await client.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        if family.name == "flowlift_active_workflows":
            return float(family.samples[0].value)
    raise RuntimeError("no flowlift_active_workflows in /metrics")


def line(row: dict[str, Any]) -> str:
    """A window as one printed line."""
    lat = {n: f"{v['p50']:.0f}/{v['p99']:.0f}" for n, v in row["latency_ms"].items()}
    return (f"window {row['window']:2d} {row['t1']:6.0f} s  {row['rate_per_min']:6.0f}/min  "
            f"started {row['started']:5d}  ended {row['ended']}  errors {row['errors']}  "
            f"in flight {row['in_flight']:3d}  RSS {row['rss_mib']:6.1f} MiB  fds "
            f"{row['fds']:4d}  open runs {row['open_runs']:3.0f}  objects {row['objects']}  "
            f"CPU % proxy {row['proxy_cpu_pct']} driver {row['driver_cpu_pct']}  "
            f"lag {row['lag_s']:.2f} s  ms p50/p99 {lat}  tables {row['tables']}")


@dataclass
class Soak:
    """One soak in progress: the proxy, the traffic's tally and what was measured."""

    opts: Options
    client: httpx.AsyncClient
    pid: int
    db: Path
    tally: Tally = field(default_factory=Tally)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    samples: list[dict[str, float]] = field(default_factory=list)
    windows: list[dict[str, Any]] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    async def sample(self) -> dict[str, float]:
        t, (rss, fds, cpu_s) = time.monotonic() - self.t0, proc_figures(self.pid)
        row = {"t": round(t, 1), "rss_mib": round(rss, 1), "fds": fds,
               "cpu_s": cpu_s, "driver_cpu_s": time.process_time(),
               "open_runs": await open_runs(self.client)}
        self.samples.append(row)
        return row

    async def pace(self) -> None:
        """Start arrival ``i`` at ``t0 + i / rate`` until the soak's end (open loop)."""
        per_s, end = self.opts.rate_per_min / 60, self.t0 + self.opts.minutes * 60
        for i in itertools.count():
            at = self.t0 + i / per_s
            if at >= end:
                return
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            self.tally.lag_s = max(self.tally.lag_s, time.monotonic() - at)
            task = asyncio.create_task(arrival(self.client, i, self.tally,
                                               self.opts.op_timeout_s))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def window(self, k: int) -> None:
        """Close window ``k`` (from 1): its figures, the proxy's tables; print it."""
        figures, in_flight = self.tally.roll(), len(self.tasks)  # at the window's end
        last = await self.sample()
        t1, w_s = last["t"], self.opts.window_s
        mine = [s for s in self.samples if s["t"] > t1 - w_s]
        before = self.samples[-len(mine) - 1]  # the previous window's last sample
        got = (await self.client.get("/soak/tables", headers={
            "Authorization": f"Bearer {TENANT_KEYS[0]}"})).json()
        row = {"window": k, "t1": t1, **figures, "in_flight": in_flight,
               "rate_per_min": figures["started"] / w_s * 60,
               "proxy_cpu_pct": round(100 * (last["cpu_s"] - before["cpu_s"])
                                      / (t1 - before["t"])),
               "driver_cpu_pct": round(100 * (last["driver_cpu_s"] - before["driver_cpu_s"])
                                       / (t1 - before["t"])),
               "db_mib": round(sum(p.stat().st_size for p in self.db.parent.glob(
                   f"{self.db.name}*")) / 2**20, 1), **got}
        for name in ("rss_mib", "fds", "open_runs"):
            row[name], row[f"{name}_max"] = last[name], max(s[name] for s in mine)
        self.windows.append(row)
        print(line(row), flush=True)

    async def observe(self) -> None:
        """Sample every ``sample_s``; close a window every ``window_s``."""
        per_window = round(self.opts.window_s / self.opts.sample_s)
        windows = round(self.opts.minutes * 60 / self.opts.window_s)
        for j in range(1, windows * per_window + 1):
            await asyncio.sleep(max(0.0, self.t0 + j * self.opts.sample_s - time.monotonic()))
            if j % per_window:
                await self.sample()
            else:
                await self.window(j // per_window)

    async def drain(self) -> dict[str, Any]:
        """Wait for the arrivals still in flight, then for the proxy's open runs to end;
        what ended after the last window, and the runs left open."""
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=self.opts.op_timeout_s + 10)
        for task in list(self.tasks):
            task.cancel()
            self.tally.error("an arrival still running after the soak's drain")
        left = await open_runs(self.client)
        for _ in range(50):
            if not left:
                break
            await asyncio.sleep(0.2)
            left = await open_runs(self.client)
        return {"after_last_window": self.tally.roll(), "left_open": left}


async def soak(opts: Options) -> dict[str, Any]:
    """Run one soak; its report (see :func:`soak_verdict.verdict`), verdict included."""
    with tempfile.TemporaryDirectory(prefix="flowlift-soak-") as tmp:
        folder = Path(tmp)
        upstream, up_url = await start_upstream()
        port = free_port()
        proc = start_proxy(folder, up_url, port, opts)
        limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits,
                                         timeout=opts.op_timeout_s) as client:
                await wait_ready(client, proc, folder / "proxy.log")
                run = Soak(opts, client, proc.pid, folder / "state.sqlite")
                await run.sample()
                await asyncio.gather(run.pace(), run.observe())
                end = await run.drain()
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            await upstream.cleanup()
    warmup_s = opts.warmup_s if opts.warmup_s is not None else opts.minutes * 20
    report = {"command": opts.argv, "rate_per_min": opts.rate_per_min,
              "window_s": opts.window_s, "warmup_s": warmup_s, "bound": opts.bound,
              "leak": opts.leak, "windows": run.windows, "samples": run.samples,
              "slopes": slopes(run.samples, run.windows, warmup_s),
              "after_last_window": end["after_last_window"], "left_open": end["left_open"],
              "errors": run.tally.first_errors}
    report["problems"] = verdict(report)
    return report


def show(report: dict[str, Any]) -> None:
    """Print the windows' table, the slopes and the verdict."""
    print("\n" + table(report["windows"]))
    print("\nslopes after the warm-up (" + f"{report['warmup_s']:g} s): " + "; ".join(
        f"{name} {line['slope_per_min']:+.2f}/min (growth {line['growth']:+.1f} from "
        f"{line['level']:.1f})" for name, line in report["slopes"].items()))
    problems = report["problems"]
    print("plateau: no slope, no error" if not problems
          else "NOT A PLATEAU:\n  " + "\n  ".join(problems))


def parse(argv: list[str] | None = None) -> tuple[Options, str | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=1000.0, help="workflows a minute")
    parser.add_argument("--window-s", type=float, default=300.0)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--warmup-s", type=float, default=None,
                        help="seconds before the fit (default: a third of the run)")
    parser.add_argument("--bound", type=int, default=0,
                        help="the proxy's tables' bound (0: flowlift serve's defaults)")
    parser.add_argument("--max-sessions", type=int, default=None,
                        help="flowlift serve --max-sessions (half the chats make a session)")
    parser.add_argument("--leak", choices=("runs", "fds"), default=None,
                        help="make the proxy leak on purpose (the soak must fail)")
    parser.add_argument("--op-timeout-s", type=float, default=60.0,
                        help="an operation not over by then is a hang (an error)")
    parser.add_argument("--fake-delay-s", type=float, default=0.02,
                        help="the embedded fake engine's seconds per streamed chunk")
    parser.add_argument("--out", default=None, help="write the report here as JSON")
    args = parser.parse_args(argv)
    per_window = args.window_s / args.sample_s
    if per_window < 1 or abs(per_window - round(per_window)) > 1e-9:
        parser.error("--window-s must be a whole multiple of --sample-s")
    return Options(minutes=args.minutes, rate_per_min=args.rate, window_s=args.window_s,
                   sample_s=args.sample_s, warmup_s=args.warmup_s, bound=args.bound,
                   max_sessions=args.max_sessions, leak=args.leak,
                   op_timeout_s=args.op_timeout_s, fake_delay_s=args.fake_delay_s,
                   argv=sys.argv[1:] if argv is None else argv), args.out


def main(argv: list[str] | None = None) -> int:
    opts, out = parse(argv)
    report = asyncio.run(soak(opts))
    show(report)
    if out:
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
