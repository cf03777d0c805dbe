"""Engine processes die with the proxy, on every exit (SIGKILL included).

vLLM's CPU build runs its engine core in a process it starts with multiprocessing's
``spawn`` method (a fresh interpreter: ``fork_exec``, then the parent's main module is
imported again as ``__mp_main__``). A proxy killed with ``kill -9`` runs no cleanup, so
that process would live on, holding the model's memory (and on a GPU, the GPU's). Linux's
parent-death signal closes the gap: a process that asked for it with
``prctl(PR_SET_PDEATHSIG, SIGKILL)`` is killed by the kernel when the thread that
started it ends, whatever the reason.

* :func:`marked_proxy` (around ``flowlift serve``) puts the proxy's pid in
  ``$FLOWLIFT_PROXY_PID`` (spawned children inherit the environment) and makes forked
  children ask for the signal; both end with the block (a test that calls the CLI in
  its own process is left as it was).
* :func:`adopt` runs when ``flowlift.cli`` is imported, which is the first thing a spawned
  child of the proxy does (it imports the proxy's main module): a process whose
  environment names another pid as the proxy is one of its engine processes and asks
  for the signal. A main module that is a package's ``__main__`` (``python -m
  flowlift serve``) is *not* re-imported by spawned children (multiprocessing's
  ``spawn._fixup_main_from_name`` skips ``*.__main__``), so nothing of flowlift would run
  there: :func:`marked_proxy` then names this module as the main module's spec, and a
  spawned child runs it as ``__mp_main__``, which adopts (found by the GPU smoke's
  ``--cpu-dry`` kill -9 check: the engine core outlived a ``python -m flowlift``
  proxy). Grandchildren (an engine's own workers) do the same, so they die with their
  parent, which dies with the proxy.
* :func:`die_with_parent` is the signal itself; ``flowlift run`` also starts its proxy
  with it, so a killed ``flowlift run`` takes its proxy (and so its engines) along.

The signal follows the *thread* that started the child: vLLM starts its core from the
worker thread that builds the engine (``asyncio.to_thread``), which lives as long as the
event loop's default executor, i.e. until the proxy has closed its engines. On systems
without ``prctl`` (not Linux) these functions do nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib.util
import os
import signal
import sys
from collections.abc import Iterator

PROXY_PID_ENV = "FLOWLIFT_PROXY_PID"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_hooked = False
_active = False


def die_with_parent() -> bool:
    """Ask the kernel to SIGKILL this process when its parent (thread) ends; if the parent
    is already gone (this process was re-parented to init), exit now.

    Returns:
        True when the signal is set (Linux), False where ``prctl`` is not available.
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() == 1:  # the parent died before the signal was set
        os._exit(1)
    return True


@contextlib.contextmanager
def marked_proxy() -> Iterator[None]:
    """Within the block, this process (the proxy) is the one its engine processes die
    with: children it spawns (``$FLOWLIFT_PROXY_PID``) or forks ask for the signal."""
    global _hooked, _active
    old = os.environ.get(PROXY_PID_ENV)
    os.environ[PROXY_PID_ENV] = str(os.getpid())
    main = sys.modules.get("__main__")
    main_spec = getattr(main, "__spec__", None)
    if main is not None and main_spec is not None and main_spec.name.endswith(".__main__"):
        main.__spec__ = importlib.util.find_spec(__name__)
    if not _hooked:
        os.register_at_fork(after_in_child=_forked)
        _hooked = True
    _active = True
    try:
        yield
    finally:
        _active = False
        if main is not None and main_spec is not None:
            main.__spec__ = main_spec
        if old is None:
            os.environ.pop(PROXY_PID_ENV, None)
        else:
            os.environ[PROXY_PID_ENV] = old


def _forked() -> None:
    if _active:
        die_with_parent()


def adopt() -> bool:
    """In a process the proxy started (``$FLOWLIFT_PROXY_PID`` names another process):
    die with the parent. Nothing happens anywhere else.

    Returns:
        True when this process now dies with its parent.
    """
    proxy = os.environ.get(PROXY_PID_ENV, "")
    if not proxy.isdigit() or int(proxy) == os.getpid():
        return False
    return die_with_parent()


if __name__ == "__mp_main__":  # a child spawned by a `python -m flowlift` proxy
    adopt()
