"""``flowlift run``'s proxy, supervised: a proxy that dies is reported at once and started
again on the same state database, so the script's runs resume.

The proxy runs as a child with the parent-death signal
(:func:`flowlift.local_engine.lifetime.die_with_parent`): a ``flowlift run`` that is
killed takes its proxy along, and the proxy takes its engine processes.

While the script runs, :meth:`ProxySupervisor.check` (called every ``poll_s``) notices a
proxy that exited, says so on stderr (its exit status or the signal that killed it, and
its log), starts it again with the same command (same port, same ``--state-db``) and
says when it is back. The SDK meanwhile reconnects (``workflow(..., reconnect_s=...)``)
and the proxy resumes the run from its event log. After ``max_restarts`` deaths it stops
trying and says so; the script then gets :class:`~flowlift.errors.ProxyUnavailable`.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from flowlift.local_engine.lifetime import die_with_parent

Waiter = Callable[[str, "subprocess.Popen[bytes]", Path, float], None]


def describe_exit(returncode: int) -> str:
    """``exited with status N`` or ``was killed by SIGKILL`` (a negative return code)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


class ProxySupervisor:
    """Start, watch, restart and stop ``flowlift run``'s proxy.

    Args:
        cmd: the ``flowlift serve`` command line.
        base: its base URL (said in messages).
        log_path: the file its stdout and stderr are appended to.
        wait_ready: blocks until the proxy answers ``/readyz`` (raises ``SystemExit`` when
            it cannot start): ``(base, process, log_path, timeout_s)``.
        ready_timeout_s: how long a (re)start may take.
        max_restarts: deaths after which it is left dead.
        err: where the messages go (stderr).
    """

    def __init__(self, cmd: Sequence[str], base: str, log_path: Path, wait_ready: Waiter,
                 *, ready_timeout_s: float, max_restarts: int = 3,
                 err: TextIO | None = None) -> None:
        self.cmd = list(cmd)
        self.base = base
        self.log_path = log_path
        self.wait_ready = wait_ready
        self.ready_timeout_s = ready_timeout_s
        self.max_restarts = max_restarts
        self.restarts = 0
        self.err = err or sys.stderr
        self.proc: subprocess.Popen[bytes] | None = None
        self.gave_up = False

    def _say(self, text: str) -> None:
        print(f"flowlift: {text}", file=self.err, flush=True)

    def start(self) -> None:
        """Start the proxy and wait until it is ready.

        Raises:
            SystemExit: it exited, or was not ready within ``ready_timeout_s``.
        """
        with self.log_path.open("ab") as log_file:
            self.proc = subprocess.Popen(self.cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                         preexec_fn=die_with_parent)
        self.wait_ready(self.base, self.proc, self.log_path, self.ready_timeout_s)

    def check(self) -> bool:
        """Restart the proxy if it died (saying so at once).

        Returns:
            True while a proxy is (again) running, False once it was left dead.
        """
        if self.proc is None or self.gave_up:
            return False
        if self.proc.poll() is None:
            return True
        self._say(f"the proxy (pid {self.proc.pid}) {describe_exit(self.proc.returncode)}; "
                  f"its log: {self.log_path}")
        if self.restarts >= self.max_restarts:
            self.gave_up = True
            self._say(f"not restarting it: it died {self.restarts + 1} times")
            return False
        self.restarts += 1
        self._say(f"restarting the proxy at {self.base} on the same state database "
                  f"(restart {self.restarts} of at most {self.max_restarts}); running "
                  "workflows resume where they were")
        t0 = time.monotonic()
        try:
            self.start()
        except SystemExit as exc:
            self.gave_up = True
            self._say(f"the proxy could not be restarted: {exc}")
            return False
        self._say(f"proxy restarted after {time.monotonic() - t0:.1f} s")
        return True

    def supervise(self, script: subprocess.Popen[bytes], poll_s: float = 0.2) -> int:
        """Watch the proxy until ``script`` exits.

        Returns:
            The script's exit status.
        """
        while script.poll() is None:
            self.check()
            time.sleep(poll_s)
        return script.returncode

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the proxy (SIGTERM; SIGKILL after ``timeout_s``)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
