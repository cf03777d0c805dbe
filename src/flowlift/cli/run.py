"""``flowlift run SCRIPT [ARGS...]``: run a Python script that uses ``workflow(...)``;
starts a proxy for it when none answers at ``--base-url`` and stops it afterwards; each
workflow shows its progress on stderr (``$FLOWLIFT_PROGRESS=1``)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from flowlift.cli.common import _get, _positive, engine_opts
from flowlift.credentials import API_KEY_ENV, add_api_key_argument, bearer_headers, cli_key
from flowlift.sdk.workflow import DEFAULT_BASE_URL


def _wait_ready(base: str, proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> None:
    t0 = time.monotonic()
    last_note = 0.0
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise SystemExit(f"flowlift: the proxy exited with code {proc.returncode}; "
                             f"its log ({log_path}) ends:\n{tail}")
        r = _get(f"{base}/readyz")
        if r is not None and r.status_code == 200:
            print(f"flowlift: proxy ready after {time.monotonic() - t0:.1f} s "
                  f"(engine load {r.json().get('load_time_s')} s)", file=sys.stderr, flush=True)
            return
        if r is not None and r.json().get("error"):
            raise SystemExit(f"flowlift: the engine failed to load: {r.json()['error']}")
        if time.monotonic() - last_note > 15:
            last_note = time.monotonic()
            print(f"flowlift: waiting for the engine ({time.monotonic() - t0:.0f} s) ...",
                  file=sys.stderr, flush=True)
        time.sleep(0.5)
    raise SystemExit(f"flowlift: the proxy was not ready within {timeout_s:.0f} s; see {log_path}")


def cmd_run(args: argparse.Namespace) -> int:
    """Run the script; a proxy this starts is supervised (:mod:`flowlift.supervise`)."""
    from flowlift.supervise import ProxySupervisor

    base = args.base_url.rstrip("/")
    proxy: ProxySupervisor | None = None
    running = _get(f"{base}/healthz") is not None
    if running and (args.config or args.engine or args.model):
        given = " ".join(f for f, v in (("--config", args.config), ("--engine", args.engine),
                                        ("--model", args.model)) if v)
        print(f"flowlift run: a proxy already answers at {base}; the script uses it, and "
              f"{given} do not apply to it (stop it, or give another --base-url, to start "
              "one with them)", file=sys.stderr, flush=True)
    elif args.config:  # the proxy would refuse it: say why before starting one
        from flowlift.errors import ConfigError
        from flowlift.proxy.config import load_config

        try:
            load_config(args.config)
        except ConfigError as exc:
            print(f"flowlift run: {exc.message}", file=sys.stderr)
            return 2
    if not running:
        host, _, port = base.removeprefix("http://").partition(":")
        log_dir = Path(args.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / "proxy.log"
        cmd = [sys.executable, "-m", "flowlift.cli", "serve", "--host", host,
               "--port", port or "80", "--engine", args.engine or "vllm", "--trace-dir",
               str(log_dir / "traces"), "--max-concurrency", str(args.max_concurrency),
               "--state-db", str(log_dir / "state.sqlite")]
        if args.model:
            cmd += ["--model", args.model]
        if args.config:
            cmd += ["--config", args.config]
        print(f"flowlift: starting a proxy at {base} (log: {log_path})", file=sys.stderr,
              flush=True)
        log_path.write_bytes(b"")
        proxy = ProxySupervisor(cmd, base, log_path, _wait_ready,
                                ready_timeout_s=args.ready_timeout_s)
    t0 = time.time()
    try:
        if proxy is not None:
            proxy.start()
        env = {**os.environ, "FLOWLIFT_BASE_URL": base}
        if args.api_key:  # the script's SDK sends it (flowlift.credentials)
            env[API_KEY_ENV] = args.api_key
        if not args.no_progress:  # the SDK's progress bar (flowlift.sdk.progress), stderr
            env.setdefault("FLOWLIFT_PROGRESS", "1")
        script = subprocess.Popen([sys.executable, args.script, *args.script_args], env=env)
        try:
            status = (proxy.supervise(script) if proxy is not None else script.wait())
        except KeyboardInterrupt:  # the script got the same SIGINT: let it finish
            status = script.wait()
        _say_runs(base, t0, None if proxy is None else Path(args.log_dir) / "traces",
                  cli_key(args))
        return status
    finally:
        if proxy is not None:
            proxy.stop()


def _say_runs(base: str, since: float, trace_dir: Path | None, api_key: str | None) -> None:
    """After ``flowlift run``'s script: each run it started (since ``since``, epoch s) with
    its status, trace file (``trace_dir``, when this command started the proxy) and page."""
    try:
        r = httpx.get(f"{base}/v1/workflows", params={"since": since - 1.0, "limit": 100},
                      headers=bearer_headers(api_key), timeout=10)
        runs = r.json()["data"] if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError):
        return
    for run in reversed(runs):  # oldest first
        rid = run["id"]
        # a proxy this command started stops with it: no page URL that would not answer
        trace, page = ((f"trace: {trace_dir / (rid + '.jsonl')}", f"read: `flowlift show {rid}`")
                       if trace_dir is not None else
                       (f"trace: `flowlift trace {rid}`", f"page: {base}/ui/workflows/{rid}"))
        print(f"flowlift: run {rid} ({run['name']}) {run['status']}; {trace}; {page}",
              file=sys.stderr, flush=True)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``run`` subcommand."""
    run = sub.add_parser("run", help="run a workflow script against a (started) proxy")
    run.add_argument("script", help="the Python script to run (it uses `with workflow(...)`)")
    run.add_argument("script_args", nargs=argparse.REMAINDER,
                     help="arguments passed on to the script")
    run.add_argument("--base-url", default=os.environ.get("FLOWLIFT_BASE_URL", DEFAULT_BASE_URL),
                     help="the proxy to use; one is started there when none answers "
                          "(default $FLOWLIFT_BASE_URL or http://127.0.0.1:8470)")
    add_api_key_argument(run)
    engine_opts(run)
    run.add_argument("--log-dir", default="runs", help="proxy log and traces (default runs/)")
    run.add_argument("--ready-timeout-s", type=_positive, default=900.0,
                     help="seconds to wait for a started proxy's engine to be ready "
                          "(default 900: the first start converts the model)")
    run.add_argument("--no-progress", action="store_true",
                     help="no progress bar (done / running / queued / failed steps) on "
                          "stderr; also FLOWLIFT_PROGRESS=0")
    run.add_argument("--config", default=None,
                     help="the started proxy's TOML config (models, upstreams, prices)")
    run.set_defaults(func=cmd_run)
