"""The two sides of the head-to-head: a stock vLLM OpenAI server and ``flowlift serve``,
started with the same engine arguments.

Both get the same model folder, ``float32``, eager mode, prefix caching, the same
context, the same number of sequences and the same KV cache (the CPU build sizes it
from ``VLLM_CPU_KVCACHE_SPACE``, whole GiB, set for both processes). The stock server
also gets ``--enable-prompt-tokens-details`` so its usage reports ``cached_tokens``.

:func:`stock_command` and :func:`flowlift_args` are pure (what is printed and saved);
:func:`stock_vllm` and :func:`flowlift` run the servers until their block ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from flowlift.testing import free_port, running_proxy


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """What both sides share.

    Attributes:
        model_dir: the HF-format checkpoint folder.
        kv_cache_gib: KV cache in GiB (whole numbers: the CPU build's env var is an int).
        max_num_seqs: sequences decoded together (flowlift: ``--max-concurrency``).
        max_model_len: context in tokens.
        kv_cache_blocks: a cache of exactly this many blocks (vLLM's
            ``--num-gpu-blocks-override``, flowlift's ``--kv-cache-blocks``).
    """

    model_dir: str
    kv_cache_gib: int = 1
    max_num_seqs: int = 16
    max_model_len: int = 4096
    kv_cache_blocks: int | None = None
    extra_env: tuple[tuple[str, str], ...] = ()

    def env(self) -> dict[str, str]:
        """Both servers' environment (``extra_env``: e.g. the CPU build's thread
        settings, the same for both)."""
        return {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), **dict(self.extra_env)}


def stock_command(args: EngineArgs, port: int, name: str = "default") -> list[str]:
    """The stock server's command line (vLLM's own OpenAI server, no flowlift)."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", args.model_dir, "--served-model-name", name, "--port", str(port),
            "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager",
            "--enable-prefix-caching", "--max-model-len", str(args.max_model_len),
            "--max-num-seqs", str(args.max_num_seqs), "--seed", "0",
            "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
            *(("--num-gpu-blocks-override", str(args.kv_cache_blocks))
              if args.kv_cache_blocks else ())]


def flowlift_args(args: EngineArgs, *extra: str) -> list[str]:
    """``flowlift serve`` flags for the same engine (``extra``: the side's own flags)."""
    return ["--model", args.model_dir, "--dtype", "float32",
            "--max-concurrency", str(args.max_num_seqs),
            "--max-model-len", str(args.max_model_len),
            *(("--kv-cache-blocks", str(args.kv_cache_blocks)) if args.kv_cache_blocks
              else ()), *extra]


def vllm_version() -> str:
    try:
        import vllm
    except ImportError:
        return "not installed"
    return f"vllm {vllm.__version__}"


@contextlib.contextmanager
def stock_vllm(args: EngineArgs, log: Path, ready_timeout_s: float = 900) -> Iterator[str]:
    """A stock ``python -m vllm.entrypoints.openai.api_server``; yields its base URL.
    Its whole process group (API server, engine core) is stopped at the end.

    Raises:
        RuntimeError: it exited or was not ready in time (with its log's tail).
    """
    port = free_port()
    cmd = stock_command(args, port)
    print(f"[stock] {' '.join(cmd)}  (VLLM_CPU_KVCACHE_SPACE={args.kv_cache_gib} "
          f"{' '.join('='.join(kv) for kv in args.extra_env)})", flush=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=args.env(),
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({proc.returncode}): "
                                   f"{log.read_text(errors='replace')[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                    break
            if time.monotonic() - t0 > ready_timeout_s:
                raise RuntimeError(f"vLLM not ready in {ready_timeout_s:.0f} s")
            time.sleep(0.5)
        print(f"[stock] ready in {time.monotonic() - t0:.0f} s", flush=True)
        yield base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def flowlift(args: EngineArgs, log: Path, *extra: str, fake: bool = False) -> Iterator[str]:
    """``flowlift serve`` with the embedded engine (``fake``: ``--engine fake``, for the
    smoke); yields its base URL."""
    flags = (["--engine", "fake"] if fake else flowlift_args(args)) + [
        "--state-db", ":memory:", "--log-level", "warning", *extra]
    print(f"[flowlift] flowlift serve {' '.join(flags)}  "
          f"(VLLM_CPU_KVCACHE_SPACE={args.kv_cache_gib})", flush=True)
    saved = dict(os.environ)
    os.environ.update(args.env())  # running_proxy's child inherits it
    try:
        with running_proxy(*flags, log_path=log,
                           ready_timeout_s=120 if fake else 900) as (base, _):
            yield base
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def flowlift_upstream(args: EngineArgs, log: Path, upstream: str, *extra: str,
                      fake: bool = False) -> Iterator[str]:
    """``flowlift serve --engine none`` in front of the server at ``upstream`` (a stock
    vLLM: its KV cache read from ``/metrics``, ``kv_metrics``); yields its base URL.
    The route is named ``peers`` and renamed to the upstream's first model."""
    served = model_id(upstream)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "flowlift.toml"
        config.write_text(
            f'[backends.vllm]\nkind = "openai"\nbase_url = "{upstream}/v1"\n'
            f'kv_metrics = true\nmax_connections = 256\n'
            f'first_token_timeout_s = 3600\nidle_timeout_s = 3600\n'
            f'response_timeout_s = 3600\nrename = {{ peers = "{served}" }}\n\n'
            '[models.peers]\nbackends = ["vllm"]\ntotal_timeout_s = 3600\n')
        flags = ["--engine", "none", "--config", str(config), "--state-db", ":memory:",
                 "--log-level", "warning", *extra]
        print(f"[flowlift->upstream] flowlift serve {' '.join(flags)}", flush=True)
        with running_proxy(*flags, log_path=log,
                           ready_timeout_s=120 if fake else 900) as (base, _):
            yield base


def model_id(base: str) -> str:
    """The first model ``base`` serves (``GET /v1/models``)."""
    return str(httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"])


def cpu_seconds(base: str) -> float | None:
    """CPU seconds (user + system) used so far by the server listening on ``base``'s
    port and every process under it (vLLM's engine core is a child of its front end);
    None when it cannot be found (psutil cannot see it)."""
    import psutil

    port = urllib.parse.urlsplit(base).port
    try:
        pids = {c.pid for c in psutil.net_connections("tcp")
                if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
                and c.pid is not None}
        total = 0.0
        for pid in pids:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    t = proc.cpu_times()
                    total += t.user + t.system
    except psutil.Error:
        return None
    return total if pids else None
