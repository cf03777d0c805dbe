// flowlift: render a compiler report (the JSON of POST /v1/workflows:compile) into a
// DOM element. Text only ever goes in through textContent: no markup from data.
"use strict";
(function () {
  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  const s = (ms) => (ms / 1000).toFixed(2) + " s";

  function facts(report) {
    const dl = el("dl");
    const add = (k, v, cls) => {
      dl.append(el("dt", {}, k));
      dl.append(el("dd", cls ? { class: cls } : {}, v));
    };
    add("workflow", `${report.name} (${report.workflow_class})`);
    add("steps", `${report.steps} in ${report.levels} parallel levels`);
    add("critical path", `${s(report.critical_path_ms)} over ${report.critical_path.length} steps`);
    add("total work", s(report.total_work_ms));
    add("lower bound", s(report.lower_bound_ms) + " with the configured concurrency");
    if (report.deadline_ms !== null && report.deadline_ms !== undefined) {
      add("deadline", `${s(report.deadline_ms)}: ${report.deadline_feasible ? "feasible" : "NOT feasible"}`,
          report.deadline_feasible ? "ok" : "warn");
    }
    const saved = report.prefix_groups.reduce((a, g) => a + g.tokens_saved, 0);
    add("shared prefixes", `${report.prefix_groups.length} group(s), ${saved} prompt tokens from the prefix cache`);
    add("identical calls", `${report.merges.length} merged`);
    add("model switches", String(report.model_switches));
    for (const [name, cm] of Object.entries(report.cost_models)) {
      add("cost model " + name, `${cm.source}, ${cm.samples} samples: prefill ${Math.round(cm.prefill_tps)} tok/s, ` +
          `${cm.tpot_ms.toFixed(1)} ms/token, overhead ${Math.round(cm.ttft_overhead_ms)} ms`);
    }
    return dl;
  }

  function list(title, items) {
    const box = el("div");
    if (!items.length) return box;
    box.append(el("h4", {}, title));
    const ul = el("ul");
    for (const text of items) ul.append(el("li", {}, text));
    box.append(ul);
    return box;
  }

  function nodes(report, maxRows) {
    const table = el("table", { class: "report-nodes" });
    const head = el("tr");
    for (const [h, num] of [["step"], ["lvl", 1], ["model"], ["est s", 1], ["start s", 1],
                            ["rest s", 1], ["prompt", 1], ["out", 1], ["notes"]]) {
      head.append(el("th", num ? { class: "num" } : {}, h));
    }
    table.append(head);
    for (const n of report.nodes.slice(0, maxRows)) {
      const tr = el("tr", n.critical ? { class: "critical", "data-step": n.step_id } : { "data-step": n.step_id });
      const notes = [n.critical ? "critical" : "", n.prefix_group !== null ? "prefix#" + n.prefix_group : "",
                     n.same_as ? "== " + n.same_as : ""].filter(Boolean).join(" ");
      const cells = [[n.step_id], [n.level, 1], [n.model || n.kind], [(n.est_ms / 1000).toFixed(2), 1],
                     [(n.start_ms / 1000).toFixed(2), 1], [(n.remaining_ms / 1000).toFixed(2), 1],
                     [n.prompt_tokens, 1], [n.output_tokens, 1], [notes]];
      for (const [v, num] of cells) tr.append(el("td", num ? { class: "num" } : {}, v));
      table.append(tr);
    }
    const box = el("div");
    box.append(table);
    if (report.nodes.length > maxRows) box.append(el("p", {}, `... ${report.nodes.length - maxRows} more steps (see the JSON)`));
    return box;
  }

  // one line per distinct reason: "42 steps (related_1, related_2, ...): reason"
  function grouped(breaks) {
    const by = new Map();
    for (const b of breaks) {
      if (!by.has(b.reason)) by.set(b.reason, []);
      by.get(b.reason).push(b.step_id);
    }
    return [...by].map(([reason, ids]) => ids.length === 1 ? `${ids[0]}: ${reason}` :
      `${ids.length} steps (${ids.slice(0, 3).join(", ")}${ids.length > 3 ? ", ..." : ""}): ${reason}`);
  }

  window.flowliftRenderReport = function (root, report, maxRows) {
    root.replaceChildren();
    if (!report) {
      root.append(el("p", {}, "No compiler report for this run."));
      return;
    }
    root.append(el("h3", {}, "Compiler report (the plan)"));
    root.append(facts(report));
    root.append(list("Planned critical path", [report.critical_path.join(" \u2192 ")]));
    root.append(list("Prefix groups", report.prefix_groups.slice(0, 8).map(
      (g) => `${g.steps} steps share ${g.shared_tokens} tokens (warmed by ${g.leader})`)));
    root.append(list("Identical calls merged", report.merges.slice(0, 8).map((m) => `${m.step_id} == ${m.same_as}`)));
    root.append(list("Chain breaks", grouped(report.breaks)));
    root.append(list("Residency", report.residency.map(
      (r) => `${r.model}: ${s(r.load_by_ms)} \u2013 ${s(r.keep_until_ms)} (${r.steps} steps)`)));
    root.append(nodes(report, maxRows || 60));
  };
})();
