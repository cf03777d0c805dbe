// flowlift: the compile page. With the browser compiler installed (the JSON in
// #compiler-boot, see flowlift.proxy.ui.offline) it starts Pyodide from files of this
// page's own origin, loads flowlift's compiler and compiles the pasted graph in the page:
// after that start nothing is requested from anywhere. Without it, it sends the graph to
// the proxy (POST /v1/workflows:compile). Either way it renders the report (report.js),
// the text `flowlift compile` prints, or every problem found.
"use strict";
(function () {
  const form = document.getElementById("compile-form");
  const input = document.getElementById("graph");
  const out = document.getElementById("report");
  const text = document.getElementById("report-text");
  const errors = document.getElementById("errors");
  const state = document.getElementById("compiler-state");
  const boot = JSON.parse(document.getElementById("compiler-boot").textContent);
  let compileInBrowser = null; // (text) => JSON text, once Pyodide has started

  function showErrors(lines) {
    errors.replaceChildren();
    for (const line of lines) {
      const li = document.createElement("li");
      li.textContent = line;
      errors.append(li);
    }
  }

  function show(result) {
    if (result.problems) {
      showErrors(result.problems);
      out.setAttribute("data-compiled", "error");
      return;
    }
    window.flowliftRenderReport(out, result.report, 200);
    text.textContent = result.text || "";
    out.setAttribute("data-compiled", "1");
  }

  async function compileOnProxy() {
    let response;
    try {
      response = await fetch("/v1/workflows:compile", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: input.value });
    } catch (err) {
      return { problems: ["cannot reach the proxy: " + err] };
    }
    let body;
    try {
      body = await response.json();
    } catch (err) {
      return { problems: [`the proxy answered HTTP ${response.status} without JSON`] };
    }
    if (!response.ok) {
      const e = body.error || {};
      return { problems: e.problems && e.problems.length ? e.problems : [e.message || `HTTP ${response.status}`] };
    }
    return { report: body };
  }

  async function startBrowserCompiler() {
    const t0 = performance.now();
    const base = (path) => new URL(path, document.baseURI).href;
    state.textContent = "Starting the compiler in this page (Pyodide)\u2026";
    const { loadPyodide } = await import(base(boot.pyodide + "pyodide.mjs"));
    const py = await loadPyodide({ indexURL: base(boot.pyodide), fullStdLib: false });
    await py.loadPackage(boot.wheels.map((w) => base(boot.pyodide + "wheels/" + w)),
                         { messageCallback: () => {}, checkIntegrity: false });
    const bundle = await (await fetch(base(boot.bundle))).arrayBuffer();
    py.unpackArchive(bundle, "zip", { extractDir: "/flowlift_py" });
    py.runPython(boot.python);
    const fn = py.globals.get("flowlift_compile");
    compileInBrowser = (source) => fn(source);
    const ms = Math.round(performance.now() - t0);
    state.setAttribute("data-load-ms", String(ms));
    state.setAttribute("data-ready", "1");
    state.textContent = `The compiler runs in this page (Pyodide, started in ${(ms / 1000).toFixed(1)} s): ` +
      "nothing you paste is sent anywhere.";
  }

  async function compile(event) {
    if (event) event.preventDefault();
    showErrors([]);
    out.replaceChildren();
    out.removeAttribute("data-compiled");
    text.textContent = "";
    if (!input.value.trim()) return;
    if (boot === null) {
      show(await compileOnProxy());
      return;
    }
    if (compileInBrowser === null) return; // compiled once started
    let result;
    try {
      result = JSON.parse(compileInBrowser(input.value));
    } catch (err) {
      result = { problems: ["the compiler failed: " + err] };
    }
    show(result);
  }

  form.addEventListener("submit", compile);
  if (boot === null) {
    compile();
  } else {
    startBrowserCompiler().then(() => compile(), (err) => {
      state.setAttribute("data-ready", "error");
      state.textContent = "The compiler could not start in this page: " + err;
    });
  }
})();
