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
                            ["wait s", 1], ["rest s", 1], ["prompt", 1], ["out", 1], ["notes"]]) {
      head.append(el("th", num ? { class: "num" } : {}, h));
    }
    table.append(head);
    for (const n of report.nodes.slice(0, maxRows)) {
      const tr = el("tr", n.critical ? { class: "critical", "data-step": n.step_id } : { "data-step": n.step_id });
      const notes = [n.critical ? "critical" : "", n.prefix_group !== null ? "prefix#" + n.prefix_group : "",
                     n.same_as ? "== " + n.same_as : ""].filter(Boolean).join(" ");
      const cells = [[n.step_id], [n.level, 1], [n.model || n.kind], [(n.est_ms / 1000).toFixed(2), 1],
                     [(n.start_ms / 1000).toFixed(2), 1], [((n.wait_ms || 0) / 1000).toFixed(2), 1],
                     [(n.remaining_ms / 1000).toFixed(2), 1],
                     [n.prompt_tokens, 1], [n.output_tokens, 1], [notes]];
      for (const [v, num] of cells) tr.append(el("td", num ? { class: "num" } : {}, v));
      table.append(tr);
    }
    const box = el("div");
    box.append(table);
    if (report.nodes.length > maxRows) box.append(el("p", {}, `... ${report.nodes.length - maxRows} more steps (see the JSON)`));
    return box;
  }

  // the compiler's planned schedule (engines shared, slots queued: flowlift.simulate):
  // each node from its planned start for its planned time; the critical path outlined
  function schedule(report, maxRows) {
    const NS = "http://www.w3.org/2000/svg";
    const nodes = report.nodes.filter((n) => n.kind !== "input")
      .sort((a, b) => a.start_ms - b.start_ms).slice(0, maxRows);
    const span = Math.max(1, ...nodes.map((n) => n.start_ms + n.est_ms));
    const label = 130, width = 380, row = 16, top = 18;
    const svg = document.createElementNS(NS, "svg");
    const h = top + nodes.length * row + 4;
    for (const [k, v] of [["class", "schedule"], ["width", label + width + 6], ["height", h],
                          ["viewBox", `0 0 ${label + width + 6} ${h}`]]) svg.setAttribute(k, v);
    const add = (tag, attrs, text) => {
      const node = document.createElementNS(NS, tag);
      for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
      if (text !== undefined) node.textContent = text;
      svg.append(node);
      return node;
    };
    for (const f of [0, 0.5, 1]) {
      add("text", { class: "tick-label", x: label + f * width, y: 11,
                    "text-anchor": f === 0 ? "start" : f === 1 ? "end" : "middle" }, s(f * span));
    }
    nodes.forEach((n, k) => {
      const y = top + k * row;
      add("text", { class: "label", x: 4, y: y + 11 }, n.step_id.length > 18 ? n.step_id.slice(0, 17) + "\u2026" : n.step_id);
      const bar = add("rect", { class: "plan-bar" + (n.critical ? " critical" : ""), "data-step": n.step_id,
        x: label + (n.start_ms / span) * width, y: y + 2, width: Math.max(1, (n.est_ms / span) * width), height: 11, rx: 2 });
      if (n.critical) bar.setAttribute("data-critical", "planned");
      const tip = document.createElementNS(NS, "title");
      tip.textContent = `${n.step_id}: planned ${s(n.start_ms)} + ${s(n.est_ms)}`;
      bar.append(tip);
    });
    const box = el("div");
    box.append(el("h4", {}, "Planned schedule (estimates, the engines shared as planned)"));
    box.append(svg);
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
    if (report.warnings && report.warnings.length) root.append(list("Warnings", report.warnings));
    root.append(list("Planned critical path", [report.critical_path.join(" \u2192 ")]));
    root.append(list("Prefix groups", report.prefix_groups.slice(0, 8).map(
      (g) => `${g.steps} steps share ${g.shared_tokens} tokens (warmed by ${g.leader})`)));
    root.append(list("Identical calls merged", report.merges.slice(0, 8).map((m) => `${m.step_id} == ${m.same_as}`)));
    root.append(list("Chain breaks", grouped(report.breaks)));
    root.append(list("Residency", report.residency.map(
      (r) => `${r.model}: ${s(r.load_by_ms)} \u2013 ${s(r.keep_until_ms)} (${r.steps} steps)`)));
    root.append(schedule(report, maxRows || 60));
    root.append(nodes(report, maxRows || 60));
  };
})();
