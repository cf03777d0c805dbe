"""``flowlift serve``: the sidecar proxy with the embedded engine (default bind
127.0.0.1:8470); the engines and residency manager its flags ask for."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowlift.cli.common import (
    _batch_cap,
    _fraction,
    _lease_seconds,
    _name,
    _port,
    _positive,
    _positive_int,
    _seconds,
    _slowdown,
    _steady_cap,
    engine_opts,
)
from flowlift.local_engine.lifetime import marked_proxy

if TYPE_CHECKING:  # imported where used: `flowlift --help` loads neither vLLM nor the proxy
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
        from flowlift.local_engine.engine_plan import plan_engines
        from flowlift.local_engine.vllm_engine import VLLMEngine

        def preparing(model: str | None) -> None:
            print(f"flowlift: preparing model {model or 'SmolLM2-135M-Instruct (default)'} ...",
                  file=sys.stderr, flush=True)

        # all resolved (converted, downloaded) before any engine sets vLLM's env; on a GPU
        # each gets its settings and share of the GPU (docs/gpu.md)
        for plan in plan_engines(
                [args.model, *extra], max_concurrency=args.max_concurrency,
                dtype=args.dtype, enforce_eager=getattr(args, "enforce_eager", False),
                on_prepare=preparing, budget_mb=getattr(args, "memory_budget_mb", None),
                tool_formats=getattr(args, "tool_formats", None),
                max_model_len=args.max_model_len, speculative_ngram=args.speculative_ngram,
                speculative_max_batch=args.speculative_max_batch, block_size=args.block_size,
                kv_cache_blocks=getattr(args, "kv_cache_blocks", None),
                max_num_batched_tokens=args.max_step_tokens,
                step_timings="auto" in (getattr(args, "batch_cap_when_interactive", None),
                                        getattr(args, "batch_cap", None))):
            _add(sized, plan.config.served_model_name, VLLMEngine(plan.config),
                 plan.memory_mb)
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
        args.tool_formats = file_config.tool_formats()
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


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``serve`` subcommand and its flags."""
    serve = sub.add_parser("serve", help="run the sidecar proxy with the embedded engine")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    serve.add_argument("--port", type=_port, default=8470,
                       help="port to listen on (default 8470)")
    engine_opts(serve)
    serve.add_argument("--dtype", default=None, help="engine dtype (default: each model's "
                       "own: float32, bfloat16 for the Qwen2.5-Coder pair)")
    serve.add_argument("--enforce-eager", action="store_true",
                       help="on a GPU: no CUDA graphs (quicker start, slower decoding); "
                            "the CPU build always runs eager")
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
    serve.add_argument("--working-set", dest="working_set", action="store_const",
                       const=True, default=None,
                       help="hold agent sessions back while the KV of the sessions "
                            "admitted before them fills the engine's cache (default: on; "
                            "see docs/working_set.md)")
    serve.add_argument("--no-working-set", dest="working_set", action="store_const",
                       const=False, help="admit every session's call at once (vLLM's LRU "
                       "alone decides whose KV stays)")
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
    serve.add_argument("--kv-cache-blocks", type=_positive_int, default=None, metavar="N",
                       help="KV cache of exactly N blocks (vLLM's "
                            "num_gpu_blocks_override; default: as many as the KV-cache "
                            "space holds)")
    serve.add_argument("--block-size", type=_positive_int, default=None,
                       help="KV-cache block size in tokens (default: vLLM's, 128 on CPU; "
                            "vLLM's CPU build needs a multiple of 32); smaller blocks keep "
                            "more of a session's previous answer cached")
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
