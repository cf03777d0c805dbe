"""The proxy's settings: :class:`ProxyConfig`, merged by :func:`settings` from the
command line's flags, over the config file's ``[server]`` section, over the defaults.

The config file also says which backends exist and which models they serve. A TOML
file (``flowlift serve --config flowlift.toml``)::

    [server]
    api_keys_env = "FLOWLIFT_API_KEYS"   # comma-separated proxy keys of the tenant
                                         # "default"; no key anywhere: no auth
    max_queue = 256                      # waiting requests per engine before 429
                                         # (the --max-queue flag, when given, wins)

    [backends.local]
    kind = "embedded"                    # the in-process engine (--engine / --model)
    idle = false                         # true: steps with hours of slack may wait in
                                         # the engine's idle class (tier "idle")

    [backends.vllm-a]
    kind = "openai"                      # any OpenAI-compatible upstream
    base_url = "http://10.0.0.5:8000/v1"
    api_key_env = "VLLM_API_KEY"         # secrets only from the environment
    connect_timeout_s = 5
    first_token_timeout_s = 60           # headers + first stream event
    idle_timeout_s = 60                  # between stream events
    response_timeout_s = 300             # a whole (non-streamed) answer, per attempt
    max_connections = 64                 # pooled connections (and requests in flight)
    failures_to_cool = 3                 # distinct requests in a row failed by the backend
                                         # (proxy/dispatch/upstream/health.py) before a cool-down
    cooldown_s = 30
    rename = { "llama-3-8b" = "meta-llama/Meta-Llama-3-8B-Instruct" }
    stream_usage = true                  # ask streams' usage (stream_options.include_usage)
                                         # even when the client did not; false for a
                                         # provider that rejects stream_options
    tier = "standard"                    # service tier: "priority" | "standard" | "flex"
                                         # (flex sends service_tier "flex")
    offers_flex = true                   # deferrable steps may ask service_tier "flex"
    hints = ["vllm-priority"]            # scheduler hints in the engine's own fields:
                                         # "vllm-priority" (servers started with
                                         # --scheduling-policy priority), "sglang-session",
                                         # "dynamo" (nvext.agent_hints); none by default
    input_price_per_1k = 0.15            # optional prices per 1,000 input/output tokens
    output_price_per_1k = 0.6

    [backends.openai-batch]
    kind = "openai-batch"                # the OpenAI Batch API (files + batches, 24h window)
    base_url = "https://api.openai.com/v1"
    api_key_env = "OPENAI_API_KEY"
    input_price_per_1k = 0.075           # tier is always "batch"
    output_price_per_1k = 0.3
    poll_initial_s = 5                   # polling backs off from here ...
    poll_max_s = 300                     # ... to here (capped exponential with jitter)
    turnaround_p50_s = 420               # priors of the planner until measured
    turnaround_p90_s = 3600
    margin_s = 3600                      # kept free after the p90 when planning batch
    watchdog_guard_s = 60                # a late line moves to standard this long before
                                         # its step's slack is gone

    [tenants.acme]                       # keys -> tenants (proxy/tenants.py): a tenant
    api_key_env = "ACME_KEYS"            # sees only its own runs, sessions, pages
    max_active_runs = 8                  # its runs at once, then 429
    tools = ["research"]                 # the [tools.*] servers it reaches (default none)
    requests_per_s = 5                   # its request rate, then 429 + Retry-After
    burst = 10                           # (default: requests_per_s)

    [tools.research]                     # tools the proxy runs itself (proxy/tools/):
    command = ["python", "-m", "my_mcp"] # an MCP server over stdio, or
    # url = "http://127.0.0.1:9000/mcp"  # one over Streamable HTTP, or
    # callables = ["mypkg.tools:search"] # Python functions (a sidecar deployment;
                                         # callable = "m:f" for one)
    allow = ["search", "read"]           # the tools graphs may name (default: all)
    timeout_s = 30                       # per call; then the call's result is an error
    max_result_bytes = 1000000           # a longer result is refused with an error text

    [models."llama-3-8b"]
    backends = ["vllm-a", "vllm-b"]      # replicas: session affinity, else by routing
    routing = "predicted-latency"        # or "least-loaded" | "round-robin"
    affinity_max_slowdown = 1.5          # affinity keeps its replica while predicted at
                                         # most 1.5x slower than the best one
    fallbacks = ["openai"]               # in order, when no replica can answer
    total_timeout_s = 600                # the request's whole budget, retries included
    max_attempts = 4
    price_per_1k_tokens = 0.6            # optional: the unit of cascade cost estimates
    batch = "openai-batch"               # optional: the batch backend of deferrable steps

Every problem is reported at once, naming its field (``ConfigError``); upstream keys are
read from the environment when the file is loaded, so a missing secret fails at start.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from flowlift.errors import ConfigError
from flowlift.proxy.tenants import DEFAULT_TENANT, TENANT_NAME, Tenant

EMBEDDED = "embedded"
Strategy = Literal["predicted-latency", "least-loaded", "round-robin"]
"""How a route chooses among its replicas (:mod:`flowlift.proxy.dispatch.routing.routing`)."""
TOOL_SERVER_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A ``[tools.<name>]`` server's name (what ``flowlift.proxy_tool("name.tool")`` says)."""


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Settings of one proxy (:func:`settings` merges them from flags, file and defaults).

    Attributes:
        max_concurrency: engine requests in flight per backend.
        max_body_bytes: request bodies above this get HTTP 413.
        body_idle_timeout_s: a request body that sends nothing for this long before it
            is whole is cut (HTTP 400 ``incomplete_body``; case N10).
        trace_dir: where each finished run's trace is written (JSON lines), or None.
        state_path: where durable runs live: a SQLite file, or a ``postgresql://`` URL
            (a database several proxies share); None keeps runs in memory only.
        detached_timeout_s: a run nobody listens to for this long is cancelled.
        scheduling: ``"priority"`` (class, critical path, slack; prefix-grouped
            dispatch), ``"preempt"`` (the same, and running batch requests are preempted
            for interactive work, then resumed) or ``"fcfs"`` (the baseline).
        batch_prefill_budget: prompt tokens of batch work in prefill at once.
        batch_cap_when_interactive: batch slots while interactive work runs (None: half;
            ``"auto"``: planned from the engine's step times,
            :mod:`flowlift.proxy.dispatch.slots.batch_cap`).
        interactive_slowdown: with ``"auto"``: the most an interactive step may slow
            down beside batch work (1.3: 30 %).
        batch_cap: batch slots of each embedded engine at any time, interactive work or
            not (None: no such cap; ``"auto"``: the plan beside one interactive request);
            decoding batch requests are then never preempted
            (:class:`~flowlift.proxy.dispatch.slots.scheduler.PrioritySlots`' ``steady``).
        api_keys: keys of the tenant ``default`` (``[server] api_keys_env``), sent as
            ``Authorization: Bearer``; empty, with no ``tenants``: no auth.
        tenants: the ``[tenants.*]`` of the config (:mod:`flowlift.proxy.tenants`).
        max_queue: OpenAI requests waiting per engine before the proxy answers 429.
        max_sessions, session_ttl_s: bounds of the ``X-Flowlift-Session`` table (sessions
            kept; seconds a session lives after its last turn).
        max_responses, response_ttl_s: bounds of the stored Responses API turns
            (``previous_response_id``; responses kept, seconds each lives).
        max_runs: workflow runs active at once before ``POST /v1/workflows`` answers 429.
        lease_ttl_s: on a shared (PostgreSQL) state database, how long a run's lease lasts
            unrenewed: a proxy renews its leases every third of it, and another proxy
            takes the runs of one that stopped renewing for this long.
        prefill_ahead: prefill the known start of the step that reads a tool's output
            while the tool is out (:mod:`flowlift.proxy.dispatch.slots.prefill_ahead`).
        program_scheduling: order each engine's requests by their agent session's
            attained service within a class (:mod:`flowlift.proxy.dispatch.slots.programs`);
            off with ``scheduling="fcfs"``.
        program_max_wait_s: the starvation bound of program scheduling: a request
            waiting this long goes first in its class.
        working_set: working-set admission: a session outside the working set starts
            only while the KV of the sessions expected back fits the engine's cache
            (:mod:`flowlift.proxy.dispatch.slots.working_set`); on by default (measured:
            3.1-3.8x shorter sessions than stock vLLM at 32 agent sessions under KV
            pressure, at par without pressure: bench/RESULTS.md, issue 35), off with
            ``scheduling="fcfs"``.
        prefill_ahead_max_kv_usage: KV-cache share (0 to 1) above which prefill-ahead
            stops and what runs of it is aborted.
        append_recompile: an open run's append compiles the whole grown graph (the
            behaviour before issue 24; a benchmark baseline) instead of the new nodes
            alone (:mod:`flowlift.incremental`).
    """

    max_concurrency: int = 16
    max_body_bytes: int = 32 * 1024 * 1024
    body_idle_timeout_s: float = 30.0
    trace_dir: Path | None = None
    state_path: Path | str | None = None
    detached_timeout_s: float = 300.0
    scheduling: str = "priority"
    batch_prefill_budget: int = 1024
    batch_cap_when_interactive: int | Literal["auto"] | None = None
    interactive_slowdown: float = 1.3
    batch_cap: int | Literal["auto"] | None = None
    api_keys: frozenset[str] = frozenset()
    tenants: tuple[Tenant, ...] = ()
    max_queue: int = 256
    max_sessions: int = 10_000
    session_ttl_s: float = 1800.0
    max_responses: int = 10_000
    response_ttl_s: float = 86_400.0
    max_runs: int = 4096
    lease_ttl_s: float = 15.0
    prefill_ahead: bool = True
    prefill_ahead_max_kv_usage: float = 0.7
    append_recompile: bool = False
    program_scheduling: bool = True
    program_max_wait_s: float = 30.0
    working_set: bool = True


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSpec(_Strict):
    api_keys_env: str | None = None
    max_queue: int | None = Field(default=None, ge=1)


class TenantSpec(_Strict):
    """``[tenants.<name>]``: a tenant's keys (from the environment) and limits."""

    api_key_env: str
    max_active_runs: int | None = Field(default=None, ge=1)
    requests_per_s: float | None = Field(default=None, gt=0)
    burst: int | None = Field(default=None, ge=1)
    tools: list[str] = Field(default_factory=list)
    """The ``[tools.*]`` servers this tenant's agent steps may use (default: none)."""


Tier = Literal["priority", "standard", "flex", "batch", "local"]
"""A backend's service tier, fastest and dearest first; the embedded engine is ``local``."""


class _Priced(_Strict):
    input_price_per_1k: float | None = Field(default=None, ge=0)
    """Price of 1,000 prompt tokens on this backend (any currency; None: unpriced)."""
    output_price_per_1k: float | None = Field(default=None, ge=0)
    """Price of 1,000 completion tokens on this backend."""


class EmbeddedSpec(_Priced):
    kind: Literal["embedded"]
    model: str | None = Field(default=None, min_length=1)
    """The embedded model this backend is: a known model's name
    (``flowlift.local_engine.models.known_models``), a checkpoint folder or a hub id.
    ``flowlift serve --config`` loads one engine per model named here (next to
    ``--model``). None: the proxy's first embedded model."""
    tier: Literal["local"] = "local"
    idle: bool = False
    """Offer the ``idle`` mode to the tier planner: a step with the slack for it runs
    only when nothing of a higher class waits on the engine."""
    idle_turnaround_p50_s: float = Field(default=30.0, gt=0)
    idle_turnaround_p90_s: float = Field(default=600.0, gt=0)
    tool_format: Literal["native", "constrained"] | None = None
    """How tools reach the model (docs/agents.md): ``"native"``, its own chat template
    and vLLM's ``tool_parser``; ``"constrained"``, the proxy's JSON protocol under
    constrained decoding. None: the model's default (native for the shipped Qwen pair)."""
    tool_parser: str | None = Field(default=None, min_length=1)
    """vLLM's tool parser for the model's family (``"hermes"`` for Qwen2.5)."""


Hint = Literal["vllm-priority", "sglang-session", "dynamo", "vllm-session",
               "vllm-router-program", "llm-d", "dynamo-session", "sglang-routing-key",
               "sglang-priority"]
"""A hint an upstream backend may opt in to (``hints = [...]``; what each writes:
:mod:`flowlift.proxy.dispatch.routing.hints` and ``docs/distributed.md``)."""

_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9a-z-]+$")
_NEVER_PASSED = frozenset({
    "authorization", "proxy-authorization", "cookie", "set-cookie", "host",
    "content-length", "content-type", "content-encoding", "transfer-encoding",
    "connection", "keep-alive", "te", "trailer", "upgrade", "expect", "accept",
    "accept-encoding"})
_SECRET_PARTS = ("auth", "token", "secret", "password", "passwd", "cookie", "credential",
                 "api-key", "apikey", "x-flowlift-")


def _passable(names: list[str]) -> list[str]:
    """``pass_headers`` lower-cased; a secret-bearing, hop-by-hop or body-describing
    header is refused (the client's key, cookies and flowlift's own headers never pass,
    whatever the config says)."""
    out = []
    for raw in names:
        name = raw.strip().lower()
        if not _HEADER_NAME.match(name):
            raise ValueError(f"{raw!r} is not an HTTP header name")
        if name in _NEVER_PASSED or any(part in name for part in _SECRET_PARTS):
            raise ValueError(f"{raw!r} may carry a secret or describes the proxy's own "
                             "request; it never passes upstream")
        out.append(name)
    return out


def _check_url(value: str) -> str:
    try:
        url = httpx.URL(value)
    except (httpx.InvalidURL, ValueError) as exc:
        raise ValueError(f"not a URL ({exc})") from None
    if not url.host:
        raise ValueError("the URL names no host")
    return value


class UpstreamSpec(_Priced):
    """An OpenAI-compatible upstream (OpenAI, a vLLM or SGLang fleet, llama.cpp server)."""

    kind: Literal["openai"]
    base_url: str = Field(pattern=r"^https?://")

    @field_validator("base_url")
    @classmethod
    def _parsable(cls, value: str) -> str:
        return _check_url(value)
    api_key_env: str | None = None
    connect_timeout_s: float = Field(default=5.0, gt=0)
    first_token_timeout_s: float = Field(default=60.0, gt=0)
    idle_timeout_s: float = Field(default=60.0, gt=0)
    response_timeout_s: float = Field(default=300.0, gt=0)
    max_connections: int = Field(default=64, ge=1)
    failures_to_cool: int = Field(default=3, ge=1)
    cooldown_s: float = Field(default=30.0, ge=0)
    rename: dict[str, str] = Field(default_factory=dict)
    stream_usage: bool = True
    tier: Literal["priority", "standard", "flex"] = "standard"
    """``flex`` sends ``service_tier: "flex"`` on every request (slower, cheaper;
    capacity 429s)."""
    offers_flex: bool = False
    """The backend also takes ``service_tier: "flex"`` for the steps the tier planner
    defers (flex on a standard backend)."""
    responses_api: Literal["native", "chat"] = "native"
    """How ``/v1/responses`` reaches it: ``native`` passes the request through (the backend
    keeps the state, e.g. OpenAI) when every backend of the model is ``native``;
    ``chat``: the proxy serves the Responses API itself, statefully, over the backend's
    ``/chat/completions`` (vLLM, SGLang, llama.cpp)."""
    hints: list[Hint] = Field(default_factory=list)
    """Scheduler hints written into requests in the engine's or router's own fields
    (:mod:`flowlift.proxy.dispatch.routing.hints`, ``docs/distributed.md``): vLLM ``priority``
    and ``session_id``, SGLang ``session_id`` (with ``/open_session`` and
    ``/close_session``), ``X-SMG-Routing-Key`` and ``priority``, Dynamo
    ``nvext.agent_hints`` and its session headers, vllm-router's
    ``vllm_xargs.agentic_context``, llm-d's session, fairness and objective headers.
    None by default: a server that does not take a field may reject it."""
    kv_metrics: bool = False
    """Read the server's KV cache size from its Prometheus ``/metrics`` (vLLM's
    ``vllm:cache_config_info``, at the root beside ``/v1``), so ``flowlift serve
    --working-set`` fits agent sessions into it as it does on the embedded engine
    (:mod:`flowlift.proxy.dispatch.upstream.kv_metrics`). vLLM servers only."""
    pass_headers: list[str] = Field(default_factory=list)
    """Client request headers passed to this backend as they came (case-insensitive
    names, e.g. ``x-llm-d-slo-ttft-ms``), beside the trace context flowlift always
    passes. Names that may hold a secret (``authorization``, ``cookie``, ``*key*``-ish
    names such as ``x-api-key``, ``*token*``, ``*secret*``...) and hop-by-hop headers
    are refused at load."""

    @field_validator("pass_headers")
    @classmethod
    def _pass_headers(cls, value: list[str]) -> list[str]:
        return _passable(value)

    @model_validator(mode="after")
    def _one_priority_scale(self) -> UpstreamSpec:
        if "vllm-priority" in self.hints and "sglang-priority" in self.hints:
            raise ValueError("hints: 'vllm-priority' (lower first) and 'sglang-priority' "
                             "(higher first) both write the body's 'priority'; pick the "
                             "one of the backend's engine")
        return self


class BatchSpec(_Priced):
    """The OpenAI Batch API (:mod:`flowlift.proxy.dispatch.batch.api`): always tier ``batch``."""

    kind: Literal["openai-batch"]
    base_url: str = Field(pattern=r"^https?://")
    api_key_env: str | None = None
    tier: Literal["batch"] = "batch"
    poll_initial_s: float = Field(default=5.0, gt=0)
    poll_max_s: float = Field(default=300.0, gt=0)
    turnaround_p50_s: float = Field(default=420.0, gt=0)
    """Prior of the median turnaround until measured (OpenRouter's published 7 min)."""
    turnaround_p90_s: float = Field(default=3600.0, gt=0)
    """Prior of the 90th percentile (published: 90% within an hour)."""
    margin_s: float = Field(default=3600.0, ge=0)
    """Kept free after the p90 when the planner puts a step on batch."""
    watchdog_guard_s: float = Field(default=60.0, ge=0)
    """The watchdog moves a waiting line this long before its step's slack is gone."""
    max_lines_per_file: int = Field(default=50_000, ge=1, le=50_000)
    max_bytes_per_file: int = Field(default=200 * 1024 * 1024, ge=1024,
                                    le=200 * 1024 * 1024)

    @field_validator("base_url")
    @classmethod
    def _parsable(cls, value: str) -> str:
        return _check_url(value)


BackendSpec = Annotated[EmbeddedSpec | UpstreamSpec | BatchSpec, Field(discriminator="kind")]


CALLABLE_PATH = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
"""``module:function``: a callable the proxy imports (:mod:`flowlift.proxy.tools.callables`)."""


class ToolServerSpec(_Strict):
    """``[tools.<name>]``: a tool server the proxy calls itself (:mod:`flowlift.proxy.tools`):
    exactly one of ``url`` (MCP over Streamable HTTP), ``command`` (an MCP server the
    proxy starts, over stdio) or ``callables`` (``module:function`` Python callables)."""

    url: str | None = Field(default=None, pattern=r"^https?://")
    command: list[str] | None = Field(default=None, min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables of a ``command`` server, over the ``mcp`` client's minimal
    default (``HOME``, ``PATH``, ...; never the proxy's own environment and secrets)."""
    callables: list[Annotated[str, Field(pattern=CALLABLE_PATH)]] | None = Field(
        default=None, min_length=1)
    headers: dict[str, str] = Field(default_factory=dict)
    """HTTP headers sent to a ``url`` server with every request (e.g. ``Authorization``)."""
    mode: Literal["auto", "legacy"] = "auto"
    """How an MCP connection starts: ``auto`` probes the server's protocol and falls
    back to the ``initialize`` handshake; ``legacy`` always uses the handshake (and a
    Streamable HTTP session: servers before MCP 2026-07-28)."""
    early: Literal["annotated", "always", "never"] = "annotated"
    """Which calls may start while the model's turn still streams: ``annotated`` those
    of tools the server declares ``readOnlyHint`` or ``idempotentHint`` (MCP tool
    annotations), ``always`` every call, ``never`` none (a call then starts when the
    turn ended)."""
    allow: list[str] | None = None
    """The server's tools graphs may name (None: all it lists)."""
    timeout_s: float = Field(default=30.0, gt=0)
    """Longest one call may take; then its result is an error text."""
    connect_timeout_s: float = Field(default=20.0, gt=0)
    """Longest starting (or reaching) an MCP server and listing its tools may take."""
    max_result_bytes: int = Field(default=1_000_000, ge=1)
    """A result longer than this (UTF-8 bytes of its text) is refused with an error text."""

    @field_validator("url")
    @classmethod
    def _parsable(cls, value: str | None) -> str | None:
        return None if value is None else _check_url(value)

    @model_validator(mode="before")
    @classmethod
    def _one_callable(cls, data: Any) -> Any:
        """``callable = "m:f"``: the same as ``callables = ["m:f"]``."""
        if isinstance(data, dict) and "callable" in data:
            data = dict(data)
            one = data.pop("callable")
            if "callables" in data:
                raise ValueError("give callable (one) or callables (a list), not both")
            data["callables"] = [one]
        return data

    @model_validator(mode="after")
    def _one_kind(self) -> ToolServerSpec:
        given = [k for k in ("url", "command", "callables") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("a tool server has exactly one of url (MCP over Streamable "
                             "HTTP), command (MCP over stdio) or callables "
                             f"(module:function), not {' and '.join(given) or 'none'}")
        if self.env and self.command is None:
            raise ValueError("env is for a command (stdio) server only")
        if self.headers and self.url is None:
            raise ValueError("headers are for a url (Streamable HTTP) server only")
        return self


class ModelSpec(_Strict):
    backends: list[str] = Field(min_length=1)
    fallbacks: list[str] = Field(default_factory=list)
    total_timeout_s: float = Field(default=600.0, gt=0)
    max_attempts: int = Field(default=4, ge=1, le=20)
    routing: Strategy = "predicted-latency"
    """How a replica is chosen (:mod:`flowlift.proxy.dispatch.routing.routing`)."""
    affinity_max_slowdown: float = Field(default=1.5, ge=1.0)
    """With ``routing = "predicted-latency"``: the affinity replica keeps a run or
    session while predicted at most this many times slower than the best replica."""
    price_per_1k_tokens: float | None = Field(default=None, ge=0)
    """Price of 1,000 tokens (prompt + completion) on this model, in any currency: the
    unit of the compiler's cascade cost estimate."""
    batch: str | None = None
    """The ``openai-batch`` backend that runs this model's deferrable steps, or None."""


class FileConfig(_Strict):
    """The parsed config file. ``keys`` holds upstream keys read from the environment."""

    server: ServerSpec = Field(default_factory=ServerSpec)
    backends: dict[str, BackendSpec] = Field(default_factory=dict)
    models: dict[str, ModelSpec] = Field(default_factory=dict)
    tenants: dict[str, TenantSpec] = Field(default_factory=dict)
    tools: dict[str, ToolServerSpec] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _references(self) -> FileConfig:
        problems = [f"tenants.{name}: a tenant name is 1-64 letters, digits, '.', '_' or "
                    "'-', starting with a letter or digit" for name in self.tenants
                    if not TENANT_NAME.fullmatch(name)]
        if self.server.api_keys_env and DEFAULT_TENANT in self.tenants:
            problems.append(f"tenants.{DEFAULT_TENANT}: server.api_keys_env already names "
                            f"the keys of the tenant {DEFAULT_TENANT!r}; use one of the two")
        problems += [f"tools.{name}: a tool server name is 1-64 letters, digits, '_' or '-'"
                     for name in self.tools if not TOOL_SERVER_NAME.fullmatch(name)]
        problems += [f"tenants.{name}.tools: no tool server named {ref!r} (defined: "
                     f"{', '.join(self.tools) or 'none'})"
                     for name, t in self.tenants.items() for ref in t.tools
                     if ref not in self.tools]
        for name, spec in self.models.items():
            for field in ("backends", "fallbacks"):
                for ref in getattr(spec, field):
                    if ref not in self.backends:
                        problems.append(f"models.{name}.{field}: no backend named {ref!r} "
                                        f"(defined: {', '.join(self.backends) or 'none'})")
                    elif isinstance(self.backends[ref], BatchSpec):
                        problems.append(f"models.{name}.{field}: {ref!r} is a batch "
                                        f"backend; name it in models.{name}.batch instead")
            if spec.batch is not None and not isinstance(self.backends.get(spec.batch),
                                                         BatchSpec):
                problems.append(f"models.{name}.batch: {spec.batch!r} is not a backend of "
                                'kind "openai-batch"')
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def prices(self) -> dict[str, float]:
        """Model name -> price per 1,000 tokens, for the models that set one."""
        return {name: spec.price_per_1k_tokens for name, spec in self.models.items()
                if spec.price_per_1k_tokens is not None}

    def server_settings(self) -> dict[str, Any]:
        """The :class:`ProxyConfig` fields the ``[server]`` section sets (only those)."""
        out: dict[str, Any] = {}
        if self.server.api_keys_env:
            out["api_keys"] = self.proxy_keys()
        if self.server.max_queue is not None:
            out["max_queue"] = self.server.max_queue
        if self.tenants:
            out["tenants"] = self.tenant_list()
        return out

    def tenant_list(self) -> tuple[Tenant, ...]:
        """The ``[tenants.*]`` with their keys read from the environment."""
        return tuple(Tenant(name, _split_keys(os.environ.get(spec.api_key_env, "")),
                            spec.max_active_runs, spec.requests_per_s, spec.burst,
                            frozenset(spec.tools))
                     for name, spec in self.tenants.items())

    def proxy_keys(self) -> frozenset[str]:
        """The proxy API keys clients must present (empty: no auth)."""
        if not self.server.api_keys_env:
            return frozenset()
        return _split_keys(os.environ.get(self.server.api_keys_env, ""))

    def embedded_models(self) -> list[str]:
        """The ``model`` of every embedded backend that names one, first-named first,
        each once."""
        named = [spec.model for spec in self.backends.values()
                 if isinstance(spec, EmbeddedSpec) and spec.model]
        return list(dict.fromkeys(named))

    def tool_formats(self) -> dict[str, tuple[str | None, str | None]]:
        """``model -> (tool_format, tool_parser)`` of the embedded backends that set
        either (None: the model's default)."""
        return {spec.model: (spec.tool_format, spec.tool_parser)
                for spec in self.backends.values()
                if isinstance(spec, EmbeddedSpec) and spec.model
                and (spec.tool_format or spec.tool_parser)}

    def secrets(self) -> frozenset[str]:
        """Every secret the config reads from the environment (for the log redactor)."""
        keys = {self.upstream_key(name) for name in self.backends}
        tenant_keys = {k for t in self.tenant_list() for k in t.keys}
        return self.proxy_keys() | tenant_keys | {k for k in keys if k}

    def upstream_key(self, backend: str) -> str | None:
        spec = self.backends[backend]
        if isinstance(spec, EmbeddedSpec) or not spec.api_key_env:
            return None
        return os.environ[spec.api_key_env]


def _split_keys(raw: str) -> frozenset[str]:
    return frozenset(k.strip() for k in raw.split(",") if k.strip())


def _key_problems(config: FileConfig) -> list[str]:
    """Tenants whose key variable is unset or empty, and keys two tenants share."""
    problems = [f"tenants.{name}.api_key_env: environment variable {spec.api_key_env} is "
                "not set or holds no key" for name, spec in config.tenants.items()
                if not _split_keys(os.environ.get(spec.api_key_env, ""))]
    owners: dict[str, str] = dict.fromkeys(config.proxy_keys(), DEFAULT_TENANT)
    for tenant in config.tenant_list():
        for key in tenant.keys:
            if owners.setdefault(key, tenant.name) != tenant.name:
                problems.append(f"tenants.{tenant.name}.api_key_env: a key of it is also "
                                f"a key of the tenant {owners[key]!r}")
    return problems


def load_config(path: str | Path) -> FileConfig:
    """Read and check a config file.

    Raises:
        ConfigError: unreadable file, TOML syntax, unknown or bad fields (all listed),
            references to undefined backends, or an ``*_env`` variable that is not set.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}",
                          param="--config") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start}); "
                          "save it as UTF-8 TOML", param="--config") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}",
                          param="--config") from None
    return parse_config(data, source=str(path))


def parse_config(data: dict[str, Any], *, source: str = "config") -> FileConfig:
    """:func:`load_config` for an already-parsed mapping."""
    try:
        config = FileConfig.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors(include_url=False):
            loc = ".".join(str(p) for p in err["loc"]
                           if p not in ("embedded", "openai", "openai-batch"))
            lines.append(f"{loc or '(file)'}: {err['msg']}")
        raise ConfigError(f"{source}: " + "; ".join(lines),
                          param=lines[0].split(":")[0]) from None
    missing = [f"backends.{name}.api_key_env: environment variable {spec.api_key_env} "
               "is not set" for name, spec in config.backends.items()
               if isinstance(spec, UpstreamSpec | BatchSpec) and spec.api_key_env
               and spec.api_key_env not in os.environ]
    if config.server.api_keys_env and not config.proxy_keys():
        missing.append(f"server.api_keys_env: environment variable "
                       f"{config.server.api_keys_env} is not set or holds no key")
    missing += _key_problems(config)
    if missing:
        raise ConfigError(f"{source}: " + "; ".join(missing),
                          param=missing[0].split(":")[0])
    return config


def settings(flags: Mapping[str, Any], file: FileConfig | None = None) -> ProxyConfig:
    """The proxy's settings: each field from the command line when its flag was given,
    else from the config file's ``[server]`` section when the file sets it, else
    :class:`ProxyConfig`'s default.

    Args:
        flags: :class:`ProxyConfig` field -> value, holding only the flags given on the
            command line (a flag left out does not override the file).
        file: the parsed config file, or None.

    Returns:
        The merged settings.

    Raises:
        ConfigError: a key of ``flags`` names no :class:`ProxyConfig` field.
    """
    known = {f.name for f in fields(ProxyConfig)}
    unknown = sorted(set(flags) - known)
    if unknown:
        raise ConfigError(f"not a proxy setting: {', '.join(unknown)}", param=unknown[0])
    merged = file.server_settings() if file is not None else {}
    return ProxyConfig(**{**merged, **flags})
