"""Profiling the proxy under a benchmark's load (bench/proxy_overhead.py ``--profile``):
py-spy's sampled wall-clock stacks of a running server, or cProfile's CPU time written
when the server exits; each summarized as the share of the request handler's time."""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

from bench.harness import RESULTS

ROOT = Path(__file__).resolve().parents[1]

PYSPY_OUT = RESULTS / "proxy_overhead.flowlift.pyspy.log"    # *.log: git-ignored
CPROFILE_OUT = RESULTS / "proxy_overhead.flowlift.cprofile.log"
CPROFILE_WRAPPER = """
import cProfile, sys, time
out = sys.argv[1]
sys.argv = ["flowlift", *sys.argv[2:]]
from flowlift.cli import main
prof = cProfile.Profile(time.process_time)
prof.enable()
try:
    main()
finally:
    prof.disable()
    prof.dump_stats(out)
"""


def start_pyspy(pid: int | None, venv: Path) -> subprocess.Popen[bytes] | None:
    """py-spy recording process ``pid`` into :data:`PYSPY_OUT` (raw stacks, 500 Hz);
    None when py-spy is neither on PATH nor in ``venv``."""
    spy = shutil.which("py-spy") or str(venv / "bin" / "py-spy")
    if not Path(spy).exists():
        print("[profile] py-spy not found: pip install py-spy (bash bench/setup_litellm.sh "
              "puts it in bench/.venv-litellm)", flush=True)
        return None
    PYSPY_OUT.unlink(missing_ok=True)
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--format", "raw",
                             "--rate", "500", "--nonblocking", "-o", str(PYSPY_OUT)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_pyspy(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)


def summarize_pyspy(path: Path, top: int = 40) -> dict[str, Any]:
    """Inclusive share of each frame over the samples not waiting in ``select``.

    py-spy samples wall-clock: a frame where the process was preempted (e.g. in
    ``socket.send``, which wakes the upstream on the same core) counts as busy."""
    inc: dict[str, int] = {}
    busy = idle = 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, n_s = line.rsplit(" ", 1)
        frames, n = stack.split(";"), int(n_s)
        if "select (selectors.py" in frames[-1]:
            idle += n
            continue
        busy += n
        for f in set(frames):
            inc[f] = inc.get(f, 0) + n
    rows = sorted(inc.items(), key=lambda kv: -kv[1])[:top]
    return {"what": f"inclusive % of {busy} busy samples ({idle} idle in select)",
            "file": str(path.relative_to(ROOT)),
            "top": [f"{100 * n / max(busy, 1):5.1f}%  {f}" for f, n in rows]}


def summarize_cprofile(path: Path, top: int = 40) -> dict[str, Any]:
    """Cumulative CPU time per function (process_time; profiler overhead included), as
    a share of the request handler's total."""
    import pstats
    st = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    root = max((v[3] for k, v in st.items() if k[2] == "_handle_request"), default=0.0)
    rows = sorted(((v[3], f"{k[0].replace(str(ROOT) + '/', '')}:{k[1]}({k[2]})")
                   for k, v in st.items()), reverse=True)
    skip = ("asyncio/base_events.py", "asyncio/events.py", "_contextvars")
    rows = [(t, name) for t, name in rows
            if t <= root * 1.0001 and not any(x in name for x in skip)][:top]
    by_pkg: dict[str, float] = {}  # self time by package, whole process after start-up
    for k, v in st.items():
        f = k[0]
        m = re.search(r"site-packages/([A-Za-z0-9_]+)", f)
        pkg = (m.group(1) if m else "flowlift" if f.startswith(str(ROOT))
               else "asyncio" if "/asyncio/" in f else "stdlib/builtins")
        by_pkg[pkg] = by_pkg.get(pkg, 0.0) + v[2]
    total = sum(by_pkg.values())
    return {"what": "cumulative CPU share of aiohttp's _handle_request",
            "file": str(path.relative_to(ROOT)),
            "self_time_by_package": {k: f"{100 * t / total:.1f}%" for k, t in sorted(
                by_pkg.items(), key=lambda kv: -kv[1]) if t / total >= 0.005},
            "top": [f"{100 * t / max(root, 1e-9):5.1f}%  {name}" for t, name in rows]}
