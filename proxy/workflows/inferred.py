"""Workflows inferred from plain OpenAI traffic (pure: no I/O).

An unmodified app joins a workflow by sending a workflow id with each request (header
``X-Flowlift-Workflow``, optional ``X-Flowlift-Step``; or the OpenAI ``metadata``
fields ``flowlift_workflow`` / ``flowlift_step``). Each finished call is recorded here;
:meth:`InferredWorkflows.graph` turns the calls into a real :class:`~flowlift.graph.Graph`
(one ``llm`` node per call) and :meth:`InferredWorkflows.describe` adds the compiler's
report plus what only a measurement knows (makespan, steps that ran one after another
although independent).

Dependencies are inferred from text containment: where an earlier call's output
appears verbatim in a later call's prompt, that span becomes a :class:`Ref` to the
earlier node. Parrot (Lin et al., OSDI'24) gets the same edges from Semantic Variables
the app declares; here they are recovered from the traffic, and the calls of one
workflow form one consolidated DAG as in Halo's query plans. Heuristics:

* an output counts when, stripped of surrounding whitespace, it has at least
  :data:`MIN_OUTPUT_CHARS` characters, or a whole message's text is exactly it (a chat
  continuation quoting a short answer);
* a structured answer counts by its fields too (:func:`output_pieces`): the string
  values of a JSON object, and the sections of DSPy's ``[[ ## field ## ]]`` format, for
  a framework that parses the answer and quotes only a field of it later;
* only calls that finished before the later one started can be its inputs;
* at each place the longest output wins, then the earliest place; when several calls
  produced the same text, the most recent eligible one is the source;
* an output that merely repeats text the app already had (an echo) looks like a
  dependency: containment cannot tell them apart.

Cost: each output is indexed by a 12-character anchor that starts a word inside it, so
a prompt is scanned once (C-level regex) per *distinct* message text, whatever the
number of outputs; repeated conversation history and shared preambles are scanned once
per workflow. Outputs with no such anchor fall back to ``str.find``.
"""

from __future__ import annotations

import bisect
import json
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachetools import TTLCache
from multidict import CIMultiDict, CIMultiDictProxy
from pydantic import ValidationError

from flowlift.dataflow import dependencies
from flowlift.errors import RequestError
from flowlift.graph import Graph, LLMNode, MessageTemplate, Params, Part, Ref, Text
from flowlift.proxy.wire.messages import Role, render_message

WORKFLOW_HEADER = "X-Flowlift-Workflow"
STEP_HEADER = "X-Flowlift-Step"
WORKFLOW_FIELD = "flowlift_workflow"
STEP_FIELD = "flowlift_step"
MIN_OUTPUT_CHARS = 20
MIN_WAIT_MS = 10.0  # shorter gaps are client overhead, not serialization
MAX_LISTED = 50  # parallelizable steps listed in ``observed`` (all are counted)
_MESSAGE_CHARS = 32  # what a message costs in the size bound besides its text

CompileFn = Callable[[Graph], dict[str, Any]]

_ANCHOR_CHARS = 12
_ANCHORS = re.compile(rf"(?<!\w)(?=(\w.{{{_ANCHOR_CHARS - 1}}}))", re.DOTALL)
_ID = re.compile(r"[\x21-\x7e]{1,128}")
_SECTION = re.compile(r"\[\[ ## (\w+) ## \]\]\n(.*?)(?=\[\[ ## \w+ ## \]\]|\Z)", re.DOTALL)


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None and not isinstance(headers, CIMultiDictProxy | CIMultiDict):
        # plain dicts are case-sensitive; HTTP header names are not
        low = name.lower()
        value = next((v for k, v in headers.items() if k.lower() == low), None)
    return value


def _pick(headers: Mapping[str, str], metadata: Mapping[str, Any], header: str,
          key: str) -> str | None:
    param = f"metadata.{key}"
    from_header, from_meta = _header(headers, header), metadata.get(key)
    for value, name in ((from_header, header), (from_meta, param)):
        if value is not None and not (isinstance(value, str) and _ID.fullmatch(value)):
            shown = repr(value)[:60]
            raise RequestError(f"{name} must be 1-128 printable ASCII characters with no "
                               f"spaces (got {shown}); use an id like 'ingest-42' or a UUID",
                               param=name)
    if from_header is not None and from_meta is not None and from_header != from_meta:
        raise RequestError(f"the {header} header ({from_header!r}) and {param} "
                           f"({from_meta!r}) disagree; send one of them", param=param)
    return from_header if from_header is not None else from_meta


def workflow_from(headers: Mapping[str, str], body: Any) -> tuple[str, str | None] | None:
    """The workflow a request joins: ``(workflow_id, step_name or None)``, or None.

    Read from the ``X-Flowlift-Workflow`` / ``X-Flowlift-Step`` headers or the body's
    ``metadata.flowlift_workflow`` / ``metadata.flowlift_step``; both may be given when
    they agree.

    Raises:
        RequestError: an id or step name that is not 1-128 printable ASCII characters
            without whitespace, header and metadata disagreeing, or a step name with no
            workflow id; ``param`` names the header or field.
    """
    metadata = body.get("metadata") if isinstance(body, dict) else None
    if (not metadata and isinstance(headers, CIMultiDictProxy | CIMultiDict)
            and WORKFLOW_HEADER not in headers and STEP_HEADER not in headers):
        return None  # (most requests: nothing to read, no error to find)
    metadata = metadata if isinstance(metadata, dict) else {}
    workflow = _pick(headers, metadata, WORKFLOW_HEADER, WORKFLOW_FIELD)
    step = _pick(headers, metadata, STEP_HEADER, STEP_FIELD)
    if workflow is None:
        if step is not None:
            param = STEP_HEADER if _header(headers, STEP_HEADER) else f"metadata.{STEP_FIELD}"
            raise RequestError(f"{param} was sent without a workflow id: add the "
                               f"{WORKFLOW_HEADER} header (or metadata.{WORKFLOW_FIELD})",
                               param=param)
        return None
    return workflow, step


def _params(sampling: Mapping[str, Any] | None, usage: Mapping[str, Any] | None,
            output: str) -> Params:
    """Sampling as sent (OpenAI defaults when absent); ``max_tokens`` is the observed
    completion length, so the compiler's estimates use what was generated."""
    done = (usage or {}).get("completion_tokens")
    max_tokens = min(done if isinstance(done, int) and done >= 1 else
                     max(1, len(output) // 4), 32768)
    s = sampling or {}
    stop = s.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(
        x for x in stop if isinstance(x, str)) if isinstance(stop, list) else ()
    temperature = s.get("temperature")
    try:
        return Params(max_tokens=max_tokens,
                      temperature=1.0 if temperature is None else temperature,
                      top_p=s.get("top_p") or 1.0, stop=stops, seed=s.get("seed"))
    except ValidationError:
        return Params(max_tokens=max_tokens, temperature=1.0)


@dataclass(frozen=True, slots=True)
class _Call:
    id: str
    name: str | None
    model: str
    messages: tuple[tuple[Role, str], ...]
    output: str
    usage: dict[str, Any] | None
    started_at: float  # seconds (the caller's clock)
    finished_at: float
    backend: str | None
    params: Params


@dataclass(slots=True)
class _Workflow:
    calls: list[_Call] = field(default_factory=list)
    taken: set[str] = field(default_factory=set)
    counts: dict[str, int] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)  # interned: history repeats
    chars: int = 0  # prompt and output characters as sent, for the size bound
    unnamed: int = 0
    dropped: int = 0
    truncated: bool = False

    def new_id(self, name: str | None) -> str:
        if name is None:
            self.unnamed += 1
            while f"call-{self.unnamed}" in self.taken:
                self.unnamed += 1
            candidate = f"call-{self.unnamed}"
        else:
            n = self.counts.get(name, 0) + 1
            candidate = name if n == 1 else f"{name}#{n}"
            while candidate in self.taken:
                n += 1
                candidate = f"{name}#{n}"
            self.counts[name] = n
        self.taken.add(candidate)
        return candidate

    def intern(self, text: str) -> str:
        return self.texts.setdefault(text, text)


def output_pieces(output: str) -> list[str]:
    """The texts of one call's output that a later prompt may quote, stripped of
    surrounding whitespace, empty ones left out: the whole output first, then, for a
    structured answer, each field's value: the string values of a JSON object (its top
    level), and the sections of DSPy's ChatAdapter format (``[[ ## facts ## ]]`` then
    the value, up to the next section)."""
    pieces = [output.strip()]
    if pieces[0].startswith("{"):
        try:
            doc = json.loads(pieces[0])
        except ValueError:
            doc = None
        if isinstance(doc, dict):
            pieces += [v.strip() for v in doc.values() if isinstance(v, str)]
    pieces += [m.group(2).strip() for m in _SECTION.finditer(output)]
    return [p for p in dict.fromkeys(pieces) if p]


class _Outputs:
    """Where the calls' outputs occur in prompt texts: ``(start, end, call index)``."""

    def __init__(self, calls: Sequence[_Call]) -> None:
        self.calls = calls
        self.pieces: list[tuple[str, int]] = []  # (a text a prompt may quote, its call)
        self.whole: dict[str, list[int]] = {}
        self.anchored: dict[str, list[tuple[int, int]]] = {}  # anchor -> (piece, offset)
        self.loose: list[int] = []  # long pieces without an anchor
        self.memo: dict[str, list[tuple[int, int, int]]] = {}
        self.templates: dict[tuple[Role, str, tuple[tuple[int, int, int], ...]],
                             MessageTemplate] = {}
        for i, call in enumerate(calls):
            for core in output_pieces(call.output):
                k = len(self.pieces)
                self.pieces.append((core, i))
                self.whole.setdefault(core, []).append(i)
                if len(core) < MIN_OUTPUT_CHARS:
                    continue
                m = _ANCHORS.search(core, 1)
                if m is None:
                    self.loose.append(k)
                else:
                    self.anchored.setdefault(m.group(1), []).append((k, m.start()))

    def _scan(self, text: str) -> list[tuple[int, int, int]]:
        core = text.strip()
        lead = len(text) - len(text.lstrip())
        found = {(lead, lead + len(core), i) for i in self.whole.get(core, ())}
        for key in set(_ANCHORS.findall(text)).intersection(self.anchored):
            p = text.find(key)
            while p >= 0:
                for k, offset in self.anchored[key]:
                    piece, i = self.pieces[k]
                    start = p - offset
                    if start >= 0 and text.startswith(piece, start):
                        found.add((start, start + len(piece), i))
                p = text.find(key, p + 1)
        for k in self.loose:
            piece, i = self.pieces[k]
            p = text.find(piece)
            while p >= 0:
                found.add((p, p + len(piece), i))
                p = text.find(piece, p + 1)
        return sorted(found)

    def message(self, role: Role, text: str, j: int) -> MessageTemplate:
        """A message of call ``j``: its text as Text and Refs to earlier calls. Equal
        messages with the same eligible sources share one template (history repeats)."""
        hits = self.memo.get(text)
        if hits is None:
            hits = self.memo[text] = self._scan(text)
        started = self.calls[j].started_at
        usable = tuple(h for h in hits if h[2] < j and self.calls[h[2]].finished_at <= started)
        key = (role, text, usable)
        template = self.templates.get(key)
        if template is None:
            template = self.templates[key] = MessageTemplate(
                role=role, content=self._parts(text, usable))
        return template

    def _parts(self, text: str, usable: Sequence[tuple[int, int, int]]) -> tuple[Part, ...]:
        source: dict[tuple[int, int], int] = {}
        for start, end, i in usable:
            source[(start, end)] = max(source.get((start, end), -1), i)
        out: list[Part] = []
        pos = 0
        for start, end in _longest_first(source):
            if start > pos:
                out.append(Text(text=text[pos:start]))
            out.append(Ref(ref=self.calls[source[(start, end)]].id))
            pos = end
        if pos < len(text) or not out:
            out.append(Text(text=text[pos:]))
        return tuple(out)


def _longest_first(spans: Mapping[tuple[int, int], int]) -> list[tuple[int, int]]:
    """Non-overlapping spans, the longest (then earliest) kept first; in text order."""
    kept: list[tuple[int, int]] = []
    for start, end in sorted(spans, key=lambda se: (se[0] - se[1], se[0])):
        k = bisect.bisect_left(kept, (start, end))
        if (k and kept[k - 1][1] > start) or (k < len(kept) and kept[k][0] < end):
            continue
        kept.insert(k, (start, end))
    return kept


def _build(workflow_id: str, calls: Sequence[_Call], truncated: bool) -> Graph:
    outputs = _Outputs(calls)
    nodes = [LLMNode(id=c.id, name=c.name or "", model=c.model, params=c.params,
                     messages=tuple(outputs.message(role, text, j) for role, text in c.messages))
             for j, c in enumerate(calls)]
    return Graph(id=workflow_id, name=workflow_id, nodes=tuple(nodes),
                 metadata={"inferred": True, "truncated": truncated})


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def _observed(calls: Sequence[_Call],
              deps: Mapping[str, frozenset[str]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Measured facts: ``(observed summary, per step {waited_ms, ran_after})``."""
    t0 = min(c.started_at for c in calls)
    makespan = max(c.finished_at for c in calls) - t0
    by_id = {c.id: c for c in calls}
    chain: dict[str, tuple[float, str | None]] = {}  # longest measured chain ending here
    for c in calls:  # deps always point to earlier calls
        best = max(deps[c.id], key=lambda d: chain[d][0], default=None)
        chain[c.id] = (c.finished_at - c.started_at + (chain[best][0] if best else 0.0), best)
    last = max(chain, key=lambda n: chain[n][0])
    bound, path = chain[last][0], []
    node: str | None = last
    while node is not None:
        path.append(node)
        node = chain[node][1]
    ends = sorted((c.finished_at, k) for k, c in enumerate(calls))
    per_step: dict[str, Any] = {}
    listed: list[dict[str, Any]] = []
    for j, c in enumerate(calls):
        ready = max((by_id[d].finished_at for d in deps[c.id]), default=t0)
        k = bisect.bisect_right(ends, (c.started_at, len(calls))) - 1
        while k >= 0 and ends[k][1] == j:
            k -= 1
        after = None  # the last call to finish before this one started, if independent
        if k >= 0 and ends[k][0] > ready and _ms(c.started_at - ready) >= MIN_WAIT_MS:
            after = calls[ends[k][1]].id
            listed.append({"step": c.id, "after": after,
                           "waited_ms": _ms(c.started_at - ready)})
        per_step[c.id] = {"waited_ms": _ms(max(c.started_at - ready, 0.0)),
                          "ran_after": after}
    listed.sort(key=lambda x: -x["waited_ms"])
    total = sum(c.finished_at - c.started_at for c in calls)
    return {"makespan_ms": _ms(makespan), "sum_latency_ms": _ms(total),
            "concurrency": round(total / makespan, 2) if makespan > 0 else None,
            "dependency_bound_ms": _ms(bound), "dependency_chain": path[::-1],
            "possible_saving_ms": _ms(max(makespan - bound, 0.0)),
            "parallelizable_steps": len(listed), "parallelizable": listed[:MAX_LISTED]}, \
        per_step


class InferredWorkflows:
    """The calls of each workflow seen in OpenAI traffic, bounded in every direction.

    Workflows live in a :class:`cachetools.TTLCache`: at most ``max_workflows``, each
    dropped ``ttl_s`` seconds after its last recorded call. A workflow keeps at most
    ``max_steps`` calls and ``max_chars`` characters of prompts and outputs counted as
    sent (a conversation's history again in every call, plus ``_MESSAGE_CHARS`` per
    message), which bounds its graph's JSON; past either bound nothing more is recorded
    and it is marked truncated. Equal texts are stored once. Thread-safe: :meth:`graph` and
    :meth:`describe` work on a snapshot and may run in a worker thread. Workflows are
    kept per tenant (:mod:`flowlift.proxy.tenants`; ``tenant=None``: anonymous): one
    tenant's workflow id never reaches another's calls.
    """

    def __init__(self, *, max_workflows: int = 10_000, ttl_s: float = 3600.0,
                 max_steps: int = 2_000, max_chars: int = 16_000_000,
                 timer: Callable[[], float] = time.monotonic) -> None:
        self.max_steps = max_steps
        self.max_chars = max_chars
        self._cache: TTLCache[tuple[str | None, str], _Workflow] = TTLCache(
            max_workflows, ttl_s, timer)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)

    def __contains__(self, workflow_id: object) -> bool:
        """Is ``workflow_id`` an anonymous tenant's workflow?"""
        return isinstance(workflow_id, str) and self.has(workflow_id)

    def has(self, workflow_id: str, tenant: str | None = None) -> bool:
        """Is ``workflow_id`` a workflow of ``tenant``?"""
        with self._lock:
            return (tenant, workflow_id) in self._cache

    def record(self, workflow_id: str, *, step: str | None, model: str,
               messages: list[dict[str, Any]] | None, prompt: str | None, output: str,
               usage: dict[str, Any] | None, started_at: float, finished_at: float,
               backend: str | None, sampling: Mapping[str, Any] | None = None,
               tenant: str | None = None) -> str | None:
        """Record one finished call of ``workflow_id``.

        Args:
            step: the step name sent with the request, or None (``call-N``).
            messages: OpenAI chat messages (``/v1/chat/completions``), or None.
            prompt: the prompt of ``/v1/completions`` when ``messages`` is None.
            output: the generated text; for a response with tool calls, the text of
                :func:`render_message` on the response message.
            usage: the OpenAI ``usage`` object, if any.
            started_at, finished_at: seconds on one clock (e.g. ``time.time()``).
            sampling: the request body (``temperature``, ``top_p``, ``seed``, ``stop``
                are read); None means OpenAI's defaults.
            tenant: whose call it is (None: anonymous).

        Returns:
            The step id (``name``, ``name#2`` for a repeated name, ``call-N`` for an
            unnamed call), or None when the workflow is truncated and nothing was kept.
        """
        rendered: list[tuple[Role, str]] = [
            render_message(m) if isinstance(m, Mapping) else ("user", str(m))
            for m in messages or ()] or [("user", prompt or "")]
        key = (tenant, workflow_id)
        with self._lock:
            wf = self._cache.get(key) or _Workflow()
            size = len(output) + sum(len(text) + _MESSAGE_CHARS for _, text in rendered)
            if (wf.truncated or len(wf.calls) >= self.max_steps
                    or wf.chars + size > self.max_chars):
                wf.truncated = True
                wf.dropped += 1
                self._cache[key] = wf
                return None
            step_id = wf.new_id(step)
            wf.chars += size
            wf.calls.append(_Call(
                id=step_id, name=step, model=model, output=wf.intern(output),
                messages=tuple((role, wf.intern(text)) for role, text in rendered),
                usage=dict(usage) if usage else None, started_at=started_at,
                finished_at=finished_at, backend=backend,
                params=_params(sampling, usage, output)))
            self._cache[key] = wf  # set again: the TTL counts from the last call
            return step_id

    def _snapshot(self, workflow_id: str, tenant: str | None
                  ) -> tuple[list[_Call], bool, int] | None:
        """``(calls, truncated, dropped)`` as of now: later records do not disturb it."""
        with self._lock:
            wf = self._cache.get((tenant, workflow_id))
            if wf is None or not wf.calls:
                return None
            return list(wf.calls), wf.truncated, wf.dropped

    def graph(self, workflow_id: str, tenant: str | None = None) -> Graph | None:
        """The workflow's inferred graph (valid under :func:`flowlift.dataflow.validate`
        without a model list), or None for an unknown workflow (or another tenant's)."""
        snap = self._snapshot(workflow_id, tenant)
        return None if snap is None else _build(workflow_id, snap[0], snap[1])

    def describe(self, workflow_id: str, compile_fn: CompileFn,
                 tenant: str | None = None) -> dict[str, Any] | None:
        """The ``workflow.inferred`` object, or None for an unknown workflow (or another
        tenant's).

        Args:
            compile_fn: ``graph -> report JSON`` (what ``POST /v1/workflows:compile``
                answers for that graph).

        Returns:
            ``{"id", "object": "workflow.inferred", "truncated", "dropped_calls",
            "steps": [{id, name, model, started_at, finished_at (s), latency_ms, usage,
            backend, depends_on, waited_ms, ran_after}], "observed": {makespan_ms,
            sum_latency_ms, concurrency, dependency_bound_ms, dependency_chain,
            possible_saving_ms, parallelizable_steps, parallelizable: [{step, after,
            waited_ms}]}, "graph": <wire graph>, "report": compile_fn(graph)}``.
            ``waited_ms`` is how long a step started after its inputs were known (after
            the first call when it has none); ``ran_after`` names an independent call
            it started behind, when it waited at least ``MIN_WAIT_MS``.
        """
        snap = self._snapshot(workflow_id, tenant)
        if snap is None:
            return None
        calls, truncated, dropped = snap
        graph = _build(workflow_id, calls, truncated)
        deps = dependencies(graph)
        observed, per_step = _observed(calls, deps)
        order = {c.id: k for k, c in enumerate(calls)}
        steps = [{"id": c.id, "name": c.name, "model": c.model, "started_at": c.started_at,
                  "finished_at": c.finished_at, "latency_ms": _ms(c.finished_at - c.started_at),
                  "usage": c.usage, "backend": c.backend,
                  "depends_on": sorted(deps[c.id], key=order.__getitem__),
                  **per_step[c.id]} for c in calls]
        return {"id": workflow_id, "object": "workflow.inferred", "truncated": truncated,
                "dropped_calls": dropped, "steps": steps, "observed": observed,
                "graph": graph.to_wire(), "report": compile_fn(graph)}
