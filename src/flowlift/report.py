"""The compiler's report: one data model, three faces (terminal table, JSON, web page).

``flowlift compile GRAPH.json`` prints :func:`format_report` (``--json`` prints the
model), ``POST /v1/workflows:compile`` answers with the JSON. Times are estimates in
ms under the listed cost models.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from flowlift.costs import CostModel


class _Report(BaseModel):
    model_config = ConfigDict(frozen=True)


class NodeReport(_Report):
    """One step in the planned schedule (:mod:`flowlift.simulate`): it waits ``wait_ms``
    for a slot from when its inputs are there, starts at ``start_ms``, takes ``est_ms``
    with the engines shared as planned, and ``remaining_ms`` runs from its start to the
    end of the last step that waits on it (on the critical path: to the plan's end)."""

    step_id: str
    kind: str
    model: str | None
    level: int
    deps: list[str]
    est_ms: float
    start_ms: float
    remaining_ms: float
    critical: bool
    prompt_tokens: int
    output_tokens: int
    prefix_group: int | None
    same_as: str | None
    wait_ms: float = 0.0


class PrefixGroupReport(_Report):
    shared_tokens: int
    steps: int
    leader: str
    tokens_saved: int
    members: list[str]


class MergeReport(_Report):
    step_id: str
    same_as: str


class ResidencyReport(_Report):
    model: str
    load_by_ms: float
    keep_until_ms: float
    steps: int


class BreakReport(_Report):
    step_id: str
    reason: str


class CascadeReport(_Report):
    """The expected cost of one step with a cascade (or with observed retries).

    ``failure_rates``/``observed`` per model (Laplace-smoothed rate, items seen);
    ``expected_*`` along the cascade, ``last_only_*`` with its last model alone (both
    per item, retries included); prices only when every model has one.
    """

    step_id: str
    step: str
    models: list[str]
    failure_rates: list[float]
    observed: list[int]
    expected_ms: float
    last_only_ms: float
    expected_price: float | None = None
    last_only_price: float | None = None


class TierStepReport(_Report):
    step_id: str
    tier: str
    start_s: float
    latest_start_s: float
    cost: float
    standard_cost: float


class TierPlanReport(_Report):
    """The service tier of each step under the run's deadline (:mod:`flowlift.tiers`):
    expected cost against every step on ``standard``."""

    feasible: bool
    cost: float
    standard_cost: float
    cost_ratio: float | None
    by_tier: dict[str, int]
    watchdog_risk: float = 0.0
    """Probability that some deferred step outlasts its planned window (from each tier's
    turnaround p50/p90) and the watchdog moves it to the fast tier."""
    steps: list[TierStepReport]


class DecisionReport(_Report):
    """Steps the proxy decides on (:mod:`flowlift.decisions`): which may not run, and
    the graph's work expected against its worst case (every branch runs). Work in ms
    of engine time, tokens prompt plus output; ``run_chance``: each conditional step's
    chance of running (conditions counted at 0.5, as nothing is learned about them)."""

    conditional: list[str]
    run_chance: dict[str, float]
    expected_work_ms: float
    worst_case_work_ms: float
    expected_tokens: int
    worst_case_tokens: int
    maps: dict[str, int] = {}
    """Dynamic fan-outs and their ``max_items``: each item may run, so both the
    expected and the worst-case work count ``max_items`` runs of its step."""
    groups: list[str] = []
    """First-wins and quorum groups: each resolves at its k-th fastest member, and the
    members still going then are cancelled (their work counted up to that point)."""
    critical_path_ms: float = 0.0
    """The critical path with groups resolving early (the report's own, when groups)."""
    worst_case_critical_path_ms: float = 0.0
    """The critical path when every group waits for all its members."""
    conditional_on_critical_path: list[str] = []


def _decision_lines(r: CompileReport) -> list[str]:
    d = r.decisions
    if d is None:
        return []
    names = ", ".join(d.conditional[:6]) + (" ..." if len(d.conditional) > 6 else "")
    lines = [f"decided on the proxy: {len(d.conditional)} conditional step(s) ({names}), "
             f"{len(d.groups)} group(s), {len(d.maps)} map(s); expected work "
             f"{_s(d.expected_work_ms)} and {d.expected_tokens} tokens vs worst case "
             f"(every branch runs) {_s(d.worst_case_work_ms)} and {d.worst_case_tokens} "
             "tokens"]
    if d.groups:
        lines.append(f"  groups resolving early: critical path {_s(d.critical_path_ms)} vs "
                     f"{_s(d.worst_case_critical_path_ms)} waiting for every member")
    return lines


class CompileReport(_Report):
    """Everything the compiler found about one graph. ``critical_path_ms`` is the end
    of the planned schedule (the engines shared and the slots queued as planned);
    ``critical_path`` the chain of steps that sets it, walked back from the step that
    ends last through the input that ended last; the rows (``nodes``) are that schedule:
    along the path, each step starts when the one before it ends plus its ``wait_ms``,
    and the last ends at ``critical_path_ms``."""

    name: str
    workflow_class: str
    steps: int
    levels: int
    critical_path: list[str]
    critical_path_ms: float
    total_work_ms: float
    lower_bound_ms: float
    deadline_ms: float | None
    deadline_feasible: bool | None
    prefix_groups: list[PrefixGroupReport]
    merges: list[MergeReport]
    model_switches: int
    residency: list[ResidencyReport]
    breaks: list[BreakReport]
    cost_models: dict[str, CostModel]
    nodes: list[NodeReport]
    cascades: list[CascadeReport] = []
    cascade_totals: dict[str, float] = {}
    open: bool = False
    """The graph is a run still growing: the report covers the steps known so far."""
    warnings: list[str] = []
    """Problems found before anything runs (a contract's output that cannot fit the
    step's ``max_tokens``: :func:`flowlift.output_size.size_warnings`)."""
    tier_plan: TierPlanReport | None = None
    """Each step's service tier under the deadline (None: no deadline or no tiers)."""
    decisions: DecisionReport | None = None
    """Conditional steps and expected vs worst-case work (None: every step runs)."""


def _s(ms: float) -> str:
    return f"{ms / 1000:.2f} s"


def _cascade_lines(r: CompileReport) -> list[str]:
    t = r.cascade_totals
    if not t:
        return []
    multi = [c for c in r.cascades if len(c.models) > 1]
    chains = sorted({" -> ".join(c.models) for c in multi})
    if "expected_price" in t:
        exp, alone = t["expected_price"], t["last_only_price"]
        unit = "(tokens x price per 1k tokens)"
    else:
        exp, alone, unit = t["expected_ms"] / 1000, t["last_only_ms"] / 1000, "s (no prices)"
    ratio = f" ({exp / alone:.2f}x)" if alone else ""
    lines = [f"cascades: {len(multi)} step(s) ({'; '.join(chains[:3])}): expected cost "
             f"{exp:.4g} {unit} vs {alone:.4g} with the last model alone{ratio}"]
    seen: set[tuple[str, ...]] = set()
    for c in multi:
        key = (c.step, *c.models)
        if key in seen:
            continue
        seen.add(key)
        rates = ", ".join(f"{m} {f:.0%} of {n} seen" if n else f"{m} {f:.0%} (prior)"
                          for m, f, n in zip(c.models, c.failure_rates, c.observed,
                                             strict=True))
        lines.append(f"  {key[0]}: failure rate {rates}")
    return lines


def _tier_lines(r: CompileReport) -> list[str]:
    t = r.tier_plan
    if t is None:
        return []
    ratio = f" ({t.cost_ratio:.2f}x)" if t.cost_ratio is not None else ""
    return [f"tiers: {', '.join(f'{k} {v}' for k, v in sorted(t.by_tier.items()))}; "
            f"expected cost {t.cost:.4g} vs all-standard {t.standard_cost:.4g}{ratio}; "
            f"{t.watchdog_risk:.0%} risk that the watchdog moves a step to the fast tier"
            + ("" if t.feasible else "; deadline NOT feasible even all on the fast tier")]


def format_report(r: CompileReport, max_rows: int = 40) -> str:
    """A readable terminal summary of a compile report."""
    lines = [f"workflow {r.name!r} ({r.workflow_class}): {r.steps} steps in {r.levels} "
             "parallel levels" + (" (open run: the steps known so far)" if r.open else ""),
             f"critical path: {_s(r.critical_path_ms)} over {len(r.critical_path)} steps, "
             "engines shared as planned "
             f"({' -> '.join(r.critical_path[:8])}{' ...' if len(r.critical_path) > 8 else ''})",
             f"total work {_s(r.total_work_ms)}; lower bound with the configured concurrency "
             f"{_s(r.lower_bound_ms)}"]
    if r.deadline_ms is not None:
        verdict = "feasible" if r.deadline_feasible else "NOT feasible"
        lines.append(f"deadline {_s(r.deadline_ms)}: {verdict}")
    saved = sum(g.tokens_saved for g in r.prefix_groups)
    lines.append(f"shared prefixes: {len(r.prefix_groups)} group(s), {saved} prompt tokens "
                 "served from the prefix cache instead of prefilled")
    for g in r.prefix_groups[:5]:
        lines.append(f"  {g.steps} steps share {g.shared_tokens} tokens (warmed by {g.leader})")
    lines.append(f"identical calls merged: {len(r.merges)}")
    lines.append(f"model switches: {r.model_switches}; residency: " + ", ".join(
        f"{x.model} {_s(x.load_by_ms)}-{_s(x.keep_until_ms)} ({x.steps} steps)"
        for x in r.residency))
    for name, cm in r.cost_models.items():
        lines.append(f"cost model {name} ({cm.source}, {cm.samples} samples): prefill "
                     f"{cm.prefill_tps:.0f} tok/s, {cm.tpot_ms:.1f} ms/token, "
                     f"overhead {cm.ttft_overhead_ms:.0f} ms")
    lines += _cascade_lines(r)
    if r.warnings:
        lines.append(f"warnings: {len(r.warnings)}")
        lines += [f"  {w}" for w in r.warnings[:10]]
    lines += _tier_lines(r)
    lines += _decision_lines(r)
    if r.breaks:
        lines.append(f"chain breaks: {len(r.breaks)}")
        lines += [f"  {b.step_id}: {b.reason}" for b in r.breaks[:5]]
    lines.append("")
    lines.append(f"{'step':<24} {'lvl':>3} {'model':<22} {'est s':>7} {'start s':>8} "
                 f"{'wait s':>6} {'rest s':>7} {'prompt':>6} {'out':>4}  notes")
    tiers = {t.step_id: t.tier for t in r.tier_plan.steps} if r.tier_plan else {}
    for n in r.nodes[:max_rows]:
        tier = tiers.get(n.step_id)
        notes = " ".join(x for x in (f"tier={tier}" if tier else "",
                                     "*critical" if n.critical else "",
                                     "?conditional" if r.decisions and n.step_id in
                                     r.decisions.run_chance else "",
                                     f"prefix#{n.prefix_group}" if n.prefix_group is not None
                                     else "", f"=={n.same_as}" if n.same_as else "") if x)
        lines.append(f"{n.step_id[:24]:<24} {n.level:>3} {(n.model or '-')[:22]:<22} "
                     f"{n.est_ms / 1000:>7.2f} {n.start_ms / 1000:>8.2f} "
                     f"{n.wait_ms / 1000:>6.2f} {n.remaining_ms / 1000:>7.2f} "
                     f"{n.prompt_tokens:>6} {n.output_tokens:>4}"
                     f"  {notes}")
    if len(r.nodes) > max_rows:
        lines.append(f"... {len(r.nodes) - max_rows} more steps (--json for all)")
    return "\n".join(lines)
