"""gridrl services run as subprocesses for a test: :func:`start_service` and its
:class:`Service`.

A helper module with a name no test package shares (like ``waiting.py``), imported as
``from service_procs import start_service``: ``from conftest import ...`` would pick whichever
``conftest`` module pytest imported first in the session (``tests/master/conftest.py`` when the
master's tests run before), not ``tests/conftest.py``. The ``service_factory`` fixture of
``tests/conftest.py`` uses it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from waiting import wait_for

BIN = Path(sys.executable).parent


class Service:
    """A gridrl service started as a subprocess; ``address`` comes from its --ready-file."""

    def __init__(self, proc: subprocess.Popen, info: dict, log_path: Path) -> None:
        self.proc = proc
        self.info = info
        self.address: str = info["address"]
        self.metrics_port: int = info["metrics_port"]
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class _Starting:
    """What :func:`wait_for` watches while a service starts: its process and its log."""

    def __init__(self, proc: subprocess.Popen, log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_service(argv: list[str], tmp_path: Path, name: str, timeout: float = 120,
                  env: dict[str, str] | None = None) -> Service:
    """Run ``argv + ['--ready-file', F]`` and wait until F appears (the server is bound).

    Raises:
        AssertionError: the service exited first (its log's tail in the message) or was not
            ready in ``timeout`` seconds (then it is killed).
    """
    ready = tmp_path / f"{name}.ready.json"
    ready.unlink(missing_ok=True)
    log_path = tmp_path / f"{name}.log"
    cmd = [str(BIN / argv[0]), *argv[1:], "--ready-file", str(ready)]
    proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    try:
        wait_for(ready.exists, timeout, f"{name} to be ready", alive=_Starting(proc, log_path),
                 every_s=0.1)
    except AssertionError:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise
    return Service(proc, json.loads(ready.read_text()), log_path)
