// flowlift: the compile page. Sends the pasted graph to POST /v1/workflows:compile
// and renders the report (report.js) or every problem the proxy found.
"use strict";
(function () {
  const form = document.getElementById("compile-form");
  const input = document.getElementById("graph");
  const out = document.getElementById("report");
  const errors = document.getElementById("errors");

  function showErrors(lines) {
    errors.replaceChildren();
    for (const line of lines) {
      const li = document.createElement("li");
      li.textContent = line;
      errors.append(li);
    }
  }

  async function compile(event) {
    if (event) event.preventDefault();
    showErrors([]);
    out.replaceChildren();
    let response;
    try {
      response = await fetch("/v1/workflows:compile", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: input.value });
    } catch (err) {
      showErrors(["cannot reach the proxy: " + err]);
      return;
    }
    let body;
    try {
      body = await response.json();
    } catch (err) {
      showErrors([`the proxy answered HTTP ${response.status} without JSON`]);
      return;
    }
    if (!response.ok) {
      const e = body.error || {};
      showErrors(e.problems && e.problems.length ? e.problems : [e.message || `HTTP ${response.status}`]);
      return;
    }
    window.flowliftRenderReport(out, body, 200);
    out.setAttribute("data-compiled", "1");
  }

  form.addEventListener("submit", compile);
  if (input.value.trim()) compile();
})();
