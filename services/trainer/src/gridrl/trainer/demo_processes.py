"""The demo's child processes: started in their own sessions, dying with the demo, stopped in
order on a first stop signal and killed all at once on a second (:class:`Children`); a service
started with ``--ready-file`` whose address is read back from it (:class:`Service`).
:mod:`.demo` decides what runs and in which order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

#: where the gridrl console scripts are (next to this Python)
BIN = Path(sys.executable).parent

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Children:
    """Every process the demo started, and their end whatever the user presses.

    The first stop signal raises ``KeyboardInterrupt`` in the demo (unless its clean-up has
    begun), which then stops the processes in order; any later one kills every child's
    process group at once (:meth:`kill_all`) and never raises, so no second Ctrl-C can break
    out of the clean-up. Install with ``signal.signal(sig, children.on_signal)``.

    Attributes:
        signals: stop signals received so far.
        first: the first one's name (``SIGINT``...), None before one.
        aborted: the name of the signal that killed the children, None while none did.
        cleaning: the clean-up has begun (a first signal then raises nothing).
    """

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.signals = 0
        self.first: str | None = None
        self.aborted: str | None = None
        self.cleaning = False
        self.killed: list[str] = []

    def start(self, name: str, argv: list[str], **kw: object) -> subprocess.Popen:
        """``subprocess.Popen(argv)`` in its own session, dying with the demo, registered
        before any signal can interrupt the demo (stop signals are blocked around the start;
        the child unblocks them)."""
        parent, prctl = os.getpid(), _prctl()  # resolved here: no dlopen in the child
        old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            proc = subprocess.Popen(argv, start_new_session=True,
                                    preexec_fn=lambda: _child_setup(parent, old, prctl),
                                    **kw)  # type: ignore[call-overload]
            self.procs.append((name, proc))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        return proc

    def on_signal(self, signum: int, frame: object) -> None:
        """The stop signals' handler (see the class docstring)."""
        self.signals += 1
        if self.signals == 1:
            self.first = signal.Signals(signum).name
            if not self.cleaning:
                self.cleaning = True
                raise KeyboardInterrupt
            return
        self.aborted = self.aborted or signal.Signals(signum).name
        self.kill_all()

    def kill_all(self) -> None:
        """SIGKILL the process group of every child still running (its own children too)."""
        for name, proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                if name not in self.killed:
                    self.killed.append(name)

    def exit_code(self) -> int:
        """128 + the first signal's number (130: Ctrl-C)."""
        return 128 + int(getattr(signal, self.first or "SIGINT"))


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` (Linux), else None."""
    if sys.platform != "linux":
        return None
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl


def _child_setup(parent: int, mask: set[signal.Signals],
                 prctl: Callable[..., int] | None) -> None:
    """In a child between fork and exec: die with the demo (Linux's ``PR_SET_PDEATHSIG``:
    SIGKILL when the demo ends, however it ends; at once if it already has), and take back
    the signal mask the demo had before blocking the stop signals."""
    if prctl is not None:
        prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the demo ended before the guard was set
            os._exit(1)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class Service:
    """A child process started with ``--ready-file``; ``address`` is read back from it."""

    def __init__(self, name: str, argv: list[str], workdir: Path, children: Children,
                 timeout_s: float = 600) -> None:
        self.name = name
        ready = workdir / f"{name}.ready.json"
        self.log_path = workdir / f"{name}.log"
        self.proc = children.start(
            name, [str(BIN / argv[0]), *argv[1:], "--ready-file", str(ready)],
            stdout=self.log_path.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}; log:\n"
                                   + self.log_path.read_text()[-4000:])
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} was not ready within {timeout_s:.0f} s")
            time.sleep(0.2)
        self.info = info = json.loads(ready.read_text())
        self.address: str = info["address"]
        self.metrics_port: int = info["metrics_port"]

    def stop(self, timeout_s: float = 15) -> None:
        """SIGTERM (graceful: health NOT_SERVING, in-flight calls finish), then SIGKILL."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
