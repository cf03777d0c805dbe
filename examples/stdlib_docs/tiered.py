"""The example pipeline as a detached run under a deadline of hours, on service tiers, in
one command (no model, no key: a fake OpenAI provider with a Batch API stands in)::

    python examples/stdlib_docs/tiered.py [--limit N] [--deadline-hours 6]
                                          [--time-scale 600] [--port 8470]

1. starts the fake provider (``python -m flowlift.testing.openai``: chat completions for
   the standard and flex tiers, the Batch API with turnaround drawn from OpenRouter's
   published figures, median 7 minutes, 90% within an hour, time-compressed
   ``--time-scale`` times);
2. starts a proxy (``flowlift serve --engine none``) with ``tiers.toml`` pointed at it;
3. runs ``pipeline.py --detach --deadline-hours H``: it submits the run and exits;
4. shows ``flowlift runs`` (state, progress, deadline, spend so far): the run waits for
   its ``@tool`` steps;
5. runs ``pipeline.py --attach HANDLE``: it follows the run, runs the ``related`` tool
   steps, and prints the table, the tier that served each step and the cost against
   every step on standard;
6. checks with the fake's own batch list that no batch line was submitted twice.

Everything a run leaves is under ``--out`` (default ``runs/tiers/``): the proxy's log and
state database, the handle, ``summary.json`` (what the last steps found, for tests).

Time: the fake compresses the batch tier's turnaround only; the proxy's deadline clock
is real time, so a run planned for hours takes about a minute here, and the turnaround
the proxy learns from the finished batches is the provider's simulated one.

Exit status: the attach's (0 when every step succeeded), 1 when a line was submitted
twice, 2 when something could not start.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(ROOT))

from flowlift.testing import free_port, running_proxy  # noqa: E402


@contextlib.contextmanager
def fake_provider(port: int, time_scale: float, log: Path) -> Iterator[str]:
    """Run ``python -m flowlift.testing.openai`` until the block ends; yields its
    ``/v1`` URL once it answers.

    Raises:
        RuntimeError: it exited or did not answer within 60 s (with its log).
    """
    cmd = [sys.executable, "-m", "flowlift.testing.openai", "--port", str(port),
           "--time-scale", str(time_scale)]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None or time.monotonic() - t0 > 60:
                raise RuntimeError(f"the fake provider did not start: {log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def config_for(url: str, out: Path) -> Path:
    """``tiers.toml`` with its backends pointed at ``url``, written under ``out``."""
    text = (HERE / "tiers.toml").read_text().replace("http://127.0.0.1:8471/v1", url)
    path = out / "flowlift.toml"
    path.write_text(text)
    return path


def submissions(url: str) -> dict[str, Any]:
    """Every batch the fake provider holds and each line's ``custom_id``: how many
    batches, lines, and the ``run:step`` pairs submitted more than once."""
    batches: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        page = httpx.get(f"{url}/batches", params={"limit": 100, **(
            {"after": after} if after else {})}, timeout=30).json()
        batches += page["data"]
        if not page["has_more"]:
            break
        after = page["last_id"]
    seen: dict[str, int] = {}
    for batch in batches:
        content = httpx.get(f"{url}/files/{batch['input_file_id']}/content", timeout=30).text
        for line in content.splitlines():
            step = json.loads(line)["custom_id"].rpartition(":")[0]  # run:step
            seen[step] = seen.get(step, 0) + 1
    return {"batches": len(batches), "lines": sum(seen.values()),
            "twice": sorted(k for k, n in seen.items() if n > 1),
            "statuses": sorted({b["status"] for b in batches})}


def _step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def _run(cmd: list[str], env: dict[str, str], capture: Path | None = None,
         timeout_s: float = 600.0) -> int:
    """Run ``cmd`` with its output on ours (and copied to ``capture``); exit status 2
    when it outlasts ``timeout_s``."""
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        print(f"error: {cmd[1]} {' '.join(cmd[2:4])} ran past {timeout_s:.0f} s: "
              f"{(exc.output or '')[-2000:]}", file=sys.stderr)
        return 2
    sys.stdout.write(proc.stdout)
    sys.stdout.flush()
    if capture is not None:
        capture.write_text(proc.stdout)
    return proc.returncode


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--limit", type=int, default=None, help="only the first N documents")
    p.add_argument("--deadline-hours", type=float, default=6.0,
                   help="the run's deadline (default 6 hours)")
    p.add_argument("--time-scale", type=float, default=600.0,
                   help="simulated seconds of batch turnaround per real second "
                        "(default 600)")
    p.add_argument("--port", type=int, default=None,
                   help="the proxy's port (default: a free one)")
    p.add_argument("--out", default="runs/tiers", help="where the run's files go")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="give up on a step of the demo after this long (default 600)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = (ROOT / args.out).resolve() if not Path(args.out).is_absolute() else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("state.sqlite", "state.sqlite-wal", "state.sqlite-shm"):
        (out / stale).unlink(missing_ok=True)
    handle = out / "run.json"
    limit = [] if args.limit is None else ["--limit", str(args.limit)]
    pipeline = [sys.executable, str(HERE / "pipeline.py"), *limit]
    t0 = time.monotonic()
    try:
        with fake_provider(free_port(), args.time_scale, out / "fake_openai.log") as url, \
                running_proxy("--engine", "none", "--config", str(config_for(url, out)),
                              "--state-db", str(out / "state.sqlite"),
                              "--trace-dir", str(out / "traces"),
                              log_path=out / "proxy.log", ready_timeout_s=120,
                              port=args.port) as (base, _):
            env = {**os.environ, "FLOWLIFT_BASE_URL": base}
            _step(f"1. submit the run detached, deadline {args.deadline_hours:g} h")
            if _run([*pipeline, "--detach", "--deadline-hours", str(args.deadline_hours),
                     "--handle", str(handle), "--trace", str(out / "trace.jsonl")], env,
                    timeout_s=args.timeout_s):
                return 2
            _step("2. the script has exited; the run goes on (flowlift runs)")
            _run([sys.executable, "-m", "flowlift.cli", "runs", "--base-url", base,
                  "--limit", "3"], env)
            _step("3. attach: run its @tool steps here, wait for the results")
            status = _run([*pipeline, "--attach", str(handle)], env, out / "attach.txt",
                          args.timeout_s)
            _step("4. after the run (flowlift runs)")
            _run([sys.executable, "-m", "flowlift.cli", "runs", "--base-url", base,
                  "--limit", "3"], env)
            run_id = json.loads(handle.read_text())["run_id"]
            doc = httpx.get(f"{base}/v1/workflows/{run_id}", timeout=60).json()
            sent = submissions(url)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    wall_s = time.monotonic() - t0
    print(f"\nbatch tier: {sent['lines']} lines in {sent['batches']} batches "
          f"({', '.join(sent['statuses'])}); submitted twice: {len(sent['twice'])}")
    print(f"wall time {wall_s:.0f} s for a run planned against a {args.deadline_hours:g}-hour "
          f"deadline (batch turnaround compressed x{args.time_scale:g})")
    (out / "summary.json").write_text(json.dumps({
        "run_id": run_id, "status": doc.get("status"), "attach_exit": status,
        "outputs": doc.get("outputs"), "failures": doc.get("failures"),
        "spend": doc.get("spend"), "tier_plan": (doc.get("report") or {}).get("tier_plan"),
        "submissions": sent, "wall_s": round(wall_s, 1)}, indent=1))
    return 1 if sent["twice"] else status


if __name__ == "__main__":
    sys.exit(main())
