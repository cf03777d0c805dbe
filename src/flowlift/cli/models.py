"""``flowlift models``: the configured models, where each comes from (PyPI-shipped GGUF,
PyPI chunk wheels, local folder, hub id, upstream) and its state, what a running proxy
serves; ``--prepare`` downloads and converts models now."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from flowlift.cli.common import _get, _name
from flowlift.credentials import CLI_HINT, add_api_key_argument, bearer_headers, cli_key
from flowlift.sdk.workflow import DEFAULT_BASE_URL


def _model_rows(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """``(model, source, state)`` of the embedded model(s), the PyPI-packaged models and
    the config file's routes."""
    from flowlift.local_engine import models as m
    from flowlift.local_engine import packaged as pk
    from flowlift.proxy.config import EmbeddedSpec, load_config

    cfg = load_config(args.config) if args.config else None
    rows = []
    dtype = args.dtype or "float32"
    target = m._target_dir(dtype)
    state = (f"converted ({target})" if (target / m._MARKER).is_file()
             else "not converted yet (converted on first `flowlift serve`)")
    rows.append((m.DEFAULT_MODEL + " (default)",
                 f"PyPI-shipped GGUF ({m._GGUF_DIST}, {dtype})", state))
    rows += [_packaged_row(model, args.dtype) for model in pk.CATALOG.values()]
    for model in [args.model, *(args.extra_model or ()), *(cfg.embedded_models() if cfg
                                                           else ())]:
        if not model or model == m.DEFAULT_MODEL or model in pk.CATALOG:
            continue
        path = Path(model).expanduser()
        if path.is_dir():
            ok = (path / "config.json").is_file()
            rows.append((path.name, f"local path ({path.resolve()})",
                         "ready" if ok else "missing config.json"))
        elif m._HUB_ID.fullmatch(model):
            kept = m.hub_dir(model)
            rows.append((model, "hub id", f"downloaded ({kept})" if (kept / "config.json")
                         .is_file() else "not downloaded (fetched on first `flowlift serve` "
                         "when a model hub is reachable)"))
        else:
            rows.append((model, "unknown", "neither a folder nor a hub id (org/name)"))
    if cfg is not None:
        for name, route in cfg.models.items():
            kinds = [(f"embedded {spec.model or '(first embedded model)'}"
                      if isinstance(spec := cfg.backends[b], EmbeddedSpec)
                      else f"upstream {b} ({spec.base_url})") for b in route.backends]
            rows.append((name, ", ".join(kinds), "configured"))
    return rows


def _packaged_row(model: Any, dtype: str | None) -> tuple[str, str, str]:
    from flowlift.local_engine import packaged as pk

    source = (f"PyPI wheels {model.package_line()} ({model.params} Q4_K_M GGUF, "
              f"{model.gguf_bytes / 1e9:.2f} GB; license {model.license.split(' ')[0]})")
    target = pk.target_dir(model, dtype)
    if pk.prepared(model, dtype):
        size = sum(p.stat().st_size for p in target.iterdir() if p.is_file())
        return model.name, source, (f"converted ({target}, {size / 1e9:.2f} GB "
                                    f"{dtype or model.dtype})")
    kept = pk.wheel_bytes(model)
    return model.name, source, (
        "not converted yet (`flowlift models --prepare " + model.name + "`, or the first "
        "`flowlift serve` that uses it: downloads "
        + (f"{model.gguf_bytes / 1e9:.2f} GB of wheels" if not kept else
           f"the rest of the wheels ({kept / 1e9:.2f} GB kept)") + ")")


def _prepare(args: argparse.Namespace) -> int:
    """``flowlift models --prepare [NAME...]``: download and convert the named models
    (none named: those of ``--model``, ``--extra-model`` and the config file)."""
    from flowlift.errors import ConfigError, EngineError
    from flowlift.local_engine.models import resolve_model
    from flowlift.proxy.config import load_config

    names = list(args.prepare)
    if not names:
        try:
            named = load_config(args.config).embedded_models() if args.config else []
        except ConfigError as exc:
            print(f"flowlift models: {exc.message}", file=sys.stderr)
            return 2
        names = [n for n in [args.model, *(args.extra_model or ()), *named] if n] or [None]
    for name in dict.fromkeys(names):
        t0 = time.monotonic()
        try:
            served, path = resolve_model(name, args.dtype)
        except EngineError as exc:
            print(f"flowlift models: {exc.message}", file=sys.stderr)
            return 2
        print(f"flowlift models: {served} ready in {path} ({time.monotonic() - t0:.1f} s)")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from flowlift.errors import ConfigError

    if args.prepare is not None:
        return _prepare(args)
    try:
        rows = _model_rows(args)
    except ConfigError as exc:
        print(f"flowlift models: {exc.message}", file=sys.stderr)
        return 2
    width = max(len(r[0]) for r in rows)
    print("configured models:")
    for name, source, state in rows:
        print(f"  {name:<{width}}  {source}; {state}")
    base = args.base_url.rstrip("/")
    ready = _get(f"{base}/readyz")
    listed = _get(f"{base}/v1/models", bearer_headers(cli_key(args)))
    if ready is None or listed is None:
        print(f"no proxy answers at {base}")
        return 0
    body = ready.json()
    loaded = "loaded" if body.get("ready") else f"loading ({body.get('error') or 'not ready'})"
    print(f"proxy at {base}: engine {loaded}"
          + (f", load took {body['load_time_s']} s" if body.get("load_time_s") else ""))
    ids = [d.get("id") for d in listed.json().get("data", [])] if listed.status_code == 200 \
        else []
    residency = body.get("residency")
    resident = set(residency["resident"]) if residency else None
    for model_id in ids:
        state = "" if resident is None or model_id not in residency["managed"] else (
            " (loaded)" if model_id in resident else " (not loaded: loads on first use)")
        print(f"  serves {model_id}{state}")
    if residency:
        print(f"  residency budget {residency['budget_mb']:.0f} MB; loaded now: "
              f"{', '.join(residency['resident']) or '(none)'}")
    if listed.status_code != 200:
        print(f"  /v1/models answered {listed.status_code}"
              + (f" ({CLI_HINT})" if listed.status_code == 401 else ""))
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``models`` subcommand."""
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
    models.set_defaults(func=cmd_models)
