"""A stand-in for the GPU smoke on a GPU machine where vLLM cannot be installed: the
process model and the memory split of flowlift's embedded engines, checked with the
standard library and torch only (flowlift, when importable, supplies the shares).

    python scripts/gpu_standin.py            # on the GPU machine (torch with CUDA)
    python scripts/gpu_standin.py --cpu-dry  # the same checks without a GPU (the suite)

Checks, each printed as ``[PASS|FAIL|INFO] check: detail``:

1. platform: torch, CUDA, the GPU and its memory.
2. spawn from a threaded parent: a parent with live threads and a listening socket (an
   aiohttp proxy's situation) spawns, from a worker thread, a child that claims a share
   of the GPU (``torch.cuda.set_per_process_memory_fraction`` and an allocation of it)
   and reports whether it inherited the parent's socket (spawn: it must not).
3. two engines' fractions fit: two children hold their shares at once (the shares of
   :func:`flowlift.local_engine.gpu_memory.split` when flowlift is importable, else
   0.45 each).
4. unload/reload timing: a child holding its share exits; how long until the memory is
   free again (``torch.cuda.mem_get_info`` in the parent) and a new child holds it.
5. no orphan after kill -9: a "proxy" process spawns an "engine" child that asks the
   kernel to kill it when its parent thread dies (``prctl(PR_SET_PDEATHSIG)``, as
   flowlift's engine processes do); the proxy is killed with SIGKILL; the engine must be
   gone (and absent from ``nvidia-smi --query-compute-apps``).

``--cpu-dry``: "the GPU" is a simulated 256 MiB device, a share is claimed with a
bytearray, memory comes back when the child exits.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import ctypes.util
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

DRY_TOTAL = 256 << 20
OUTCOMES: list[bool | None] = []


def say(check: str, ok: bool | None, detail: str) -> None:
    mark = {True: "PASS", False: "FAIL", None: "INFO"}[ok]
    print(f"[{mark}] {check}: {detail}", flush=True)
    OUTCOMES.append(ok)


def gpu_total(dry: bool) -> int:
    if dry:
        return DRY_TOTAL
    import torch

    return int(torch.cuda.mem_get_info()[1])


def claim(share: float, dry: bool, ready: Any, release: Any, report: Any) -> None:
    """The child: claim ``share`` of the device, report, hold until ``release``."""
    started = time.perf_counter()
    sockets = [f for f in os.listdir("/proc/self/fd") if _link(f).startswith("socket:")]
    if dry:
        held: Any = bytearray(int(share * DRY_TOTAL * 0.9))
    else:
        import torch

        torch.cuda.set_per_process_memory_fraction(share)
        total = torch.cuda.mem_get_info()[1]
        held = torch.empty(int(share * total * 0.9), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
    report.put({"pid": os.getpid(), "bytes": len(held) if dry else held.numel(),
                "sockets": len(sockets), "load_s": time.perf_counter() - started})
    ready.set()
    release.wait(120)


def _link(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the fd listdir itself used, closed by now
        return ""


def spawn_claim(ctx: Any, share: float, dry: bool) -> tuple[Any, Any, Any, Any]:
    ready, release, report = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=claim, args=(share, dry, ready, release, report), daemon=True)
    proc.start()
    return proc, ready, release, report


def free_bytes(dry: bool) -> int:
    if dry:
        return DRY_TOTAL
    import torch

    return int(torch.cuda.mem_get_info()[0])


def check_spawn_from_threads(ctx: Any, dry: bool) -> None:
    listener = socket.create_server(("127.0.0.1", 0))  # what a proxy holds open
    stop = threading.Event()
    busy = [threading.Thread(target=stop.wait, daemon=True) for _ in range(4)]
    for t in busy:
        t.start()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # as asyncio.to_thread
        proc, ready, release, report = pool.submit(spawn_claim, ctx, 0.3, dry).result()
        got = ready.wait(120)
        info = report.get(timeout=5) if got else {}
        release.set()
        proc.join(30)
    stop.set()
    listener.close()
    ok = got and info.get("sockets", 1) == 0 and proc.exitcode == 0
    say("spawn from a threaded parent", ok, f"child {info.get('pid')} held "
        f"{info.get('bytes', 0) / 2**20:.0f} MiB (share 0.3), inherited sockets "
        f"{info.get('sockets')}, exit {proc.exitcode}")


def shares(dry: bool) -> list[float]:
    """Two engines' shares of this GPU as flowlift plans them (in --cpu-dry: of a
    simulated 80 GiB GPU), for two models that need 40% of it each."""
    total = (80 << 30) if dry else gpu_total(dry)
    try:
        from flowlift.local_engine import gpu_memory
    except ImportError:
        return [0.45, 0.45]
    need = int(total * 0.4)
    got = gpu_memory.split(total, {"m1": need, "m2": need})
    return [got["m1"], got["m2"]]


def check_two_fit(ctx: Any, dry: bool) -> None:
    fractions = shares(dry)
    held = [spawn_claim(ctx, f, dry) for f in fractions]
    ready = [h[1].wait(120) for h in held]
    for h in held:
        h[2].set()
        h[0].join(30)
    ok = all(ready) and all(h[0].exitcode == 0 for h in held)
    say("two engines' fractions fit", ok, f"shares {fractions} (sum {sum(fractions):.3f}), "
        f"both held at once: {all(ready)}, exits {[h[0].exitcode for h in held]}")


def check_unload_reload(ctx: Any, dry: bool) -> None:
    base = free_bytes(dry)
    proc, ready, release, report = spawn_claim(ctx, 0.4, dry)
    ready.wait(120)
    load_s = report.get(timeout=5)["load_s"]
    t0 = time.perf_counter()
    release.set()
    proc.join(30)
    exited = time.perf_counter() - t0
    while free_bytes(dry) < base * 0.98 and time.perf_counter() - t0 < 30:
        time.sleep(0.01)
    back = time.perf_counter() - t0
    again = spawn_claim(ctx, 0.4, dry)
    ok = again[1].wait(120)
    reload_s = again[3].get(timeout=5)["load_s"] if ok else float("nan")
    again[2].set()
    again[0].join(30)
    say("unload/reload", ok, f"claim {load_s:.2f} s; unload: exit {exited:.2f} s, memory "
        f"back {back:.2f} s; reload claim {reload_s:.2f} s")


def die_with_parent() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def engine(dry: bool, ready: Any) -> None:
    die_with_parent()
    held: Any = bytearray(1 << 20)
    if not dry:
        import torch

        held = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    ready.set()
    time.sleep(300)
    del held


def as_proxy(dry: bool) -> None:
    """The "proxy": spawns the engine from a worker thread it keeps, then waits."""
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    proc = pool.submit(lambda: _start(ctx, dry, ready)).result()
    ready.wait(120)
    print(proc.pid, flush=True)
    time.sleep(300)


def _start(ctx: Any, dry: bool, ready: Any) -> Any:
    proc = ctx.Process(target=engine, args=(dry, ready))
    proc.start()
    return proc


def gpu_apps() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid",
                              "--format=csv,noheader"], capture_output=True, text=True)
    except OSError:
        return ["nvidia-smi not found"]
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def check_kill9(dry: bool) -> None:
    args = [sys.executable, __file__, "--as-proxy"] + (["--cpu-dry"] if dry else [])
    proxy = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    assert proxy.stdout is not None
    timer = threading.Timer(150, proxy.kill)  # no pid line: the engine did not start
    timer.start()
    line = proxy.stdout.readline().strip()
    timer.cancel()
    child = int(line) if line.isdigit() else None
    proxy.send_signal(signal.SIGKILL)
    proxy.wait()
    deadline = time.monotonic() + 15
    while child is not None and alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = child is not None and alive(child)
    apps = [] if dry else [a for a in gpu_apps() if a == str(child)]
    if left and child is not None:
        os.kill(child, signal.SIGKILL)
    say("no orphan after kill -9", child is not None and not left and not apps,
        f"engine {child}: {'still alive' if left else 'gone'}"
        + ("" if dry else f"; nvidia-smi lists it: {bool(apps)}"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-dry", action="store_true")
    parser.add_argument("--as-proxy", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    dry = args.cpu_dry
    if args.as_proxy:
        as_proxy(dry)
        return 0
    try:
        import torch
    except ImportError:
        torch = None
    cuda = torch is not None and torch.cuda.is_available()
    version = getattr(torch, "__version__", "not installed")
    if dry:
        say("platform", None, f"cpu-dry (simulated {DRY_TOTAL >> 20} MiB device); torch "
            f"{version}")
    else:
        name = torch.cuda.get_device_name(0) if cuda else "no CUDA device"
        say("platform", cuda, f"torch {version}, {name}, "
            f"{gpu_total(False) / 2**30 if cuda else 0:.1f} GiB")
        if not cuda:
            return 1
    ctx = mp.get_context("spawn")
    for check in (check_spawn_from_threads, check_two_fit, check_unload_reload):
        try:
            check(ctx, dry)
        except Exception as exc:  # one check's failure is its line, not the end
            say(check.__name__.removeprefix("check_"), False, f"{type(exc).__name__}: {exc}")
    try:
        check_kill9(dry)
    except Exception as exc:
        say("kill9", False, f"{type(exc).__name__}: {exc}")
    failed = OUTCOMES.count(False)
    print(f"gpu_standin: {OUTCOMES.count(True)} passed, {failed} failed"
          + (" (cpu-dry: nothing ran on a GPU)" if dry else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
