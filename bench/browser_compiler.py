"""The compiler in the browser: what the compile page downloads and how long it takes to
start (Pyodide, the wheels, flowlift's modules) in headless Chromium, and each graph's
compile time in the page beside ``flowlift compile``'s in CPython, side by side.

The static page (``python -m flowlift.proxy.ui DIR``) is served by a plain file server;
each start is in a fresh browser profile (nothing cached).

    python bench/browser_compiler.py            # 3 cold starts, 5 compiles per graph
    python bench/browser_compiler.py --smoke    # 1 start, 1 compile (plumbing only)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import http.server
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from browser_graphs import VALID  # noqa: E402  (the tests' graphs)
from cdp import chromium_tab  # noqa: E402

from flowlift.browser import compile_text  # noqa: E402
from flowlift.proxy.ui import offline  # noqa: E402
from flowlift.proxy.ui.pages import static_compile_page  # noqa: E402


class Logged(http.server.SimpleHTTPRequestHandler):
    paths: list[str] = []  # noqa: RUF012 (one server per run)

    def log_message(self, format: str, *args: Any) -> None:
        Logged.paths.append(self.path)


TIME_IN_PAGE = """(() => { const t0 = performance.now();
  for (let i = 0; i < %d; i++) document.querySelector('#compile-form button').click();
  return (performance.now() - t0) / %d; })()"""


async def one_start(url: str, profile: Path, graphs: dict[str, Any], reps: int
                    ) -> tuple[float, dict[str, float]]:
    async with chromium_tab(CHROMIUM, profile) as tab:
        await tab.send("Page.navigate", url=url)
        await tab.wait_for("document.getElementById('compiler-state')"
                           ".getAttribute('data-ready')", 300)
        load_ms = float(await tab.evaluate("document.getElementById('compiler-state')"
                                           ".getAttribute('data-load-ms')"))
        per_graph = {}
        for name, graph in graphs.items():
            await tab.evaluate(f"document.getElementById('graph').value = "
                               f"{json.dumps(json.dumps(graph))}; 1")
            per_graph[name] = float(await tab.evaluate(TIME_IN_PAGE % (reps, reps)))
        return load_ms, per_graph


def cpython_ms(graph: dict[str, Any], reps: int) -> float:
    text = json.dumps(graph)
    t0 = time.perf_counter()
    for _ in range(reps):
        compile_text(text)
    return (time.perf_counter() - t0) * 1000 / reps


CHROMIUM = shutil.which("chromium") or "chromium"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="1 start, 1 compile")
    args = ap.parse_args()
    starts, reps = (1, 1) if args.smoke else (3, 5)
    graphs = {"example": VALID["example"]} if args.smoke else VALID
    if offline.boot_config() is None:
        print(f"no browser compiler: {offline.MISSING_HINT}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        offline.build_static(site, static_compile_page())
        server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(Logged, directory=str(site)))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        loads, pages = [], []
        try:
            for i in range(starts):
                Logged.paths = []
                load, per = asyncio.run(one_start(url, Path(tmp) / f"profile{i}", graphs, reps))
                loads.append(load)
                pages.append(per)
        finally:
            server.shutdown()
        sent = sum((site / p.lstrip("/").split("?")[0]).stat().st_size
                   for p in set(Logged.paths) if (site / p.lstrip("/")).is_file())
    print(f"downloaded per cold start: {sent / 1e6:.1f} MB in {len(set(Logged.paths))} files")
    print(f"start (Pyodide + wheels + flowlift, cold): median {statistics.median(loads):.0f} ms"
          f" over {starts} start(s) (min {min(loads):.0f}, max {max(loads):.0f})")
    for name in graphs:
        page = statistics.median(p[name] for p in pages)
        py = cpython_ms(graphs[name], reps)
        print(f"compile {name!r} ({len(graphs[name]['nodes'])} nodes): in the page "
              f"{page:.1f} ms, CPython {py:.1f} ms, ratio {page / py:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
