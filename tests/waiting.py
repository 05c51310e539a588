"""The one polling helper of the test suite: wait for a condition, or fail naming it.

Tests import it as ``from waiting import wait_for`` (``tests/`` is on ``sys.path`` through its
``conftest.py``). Prefer an event, a queue or an injected clock where the code under
test offers one; poll only what another process or thread changes on its own time.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

POLL_S = 0.02


def wait_for(probe: Callable[[], T], timeout_s: float = 20.0, what: str = "condition",
             alive: Any = None, every_s: float = POLL_S) -> T:
    """Call ``probe`` every ``every_s`` seconds until it returns something truthy; return it.

    Args:
        probe: returns a falsy value while the condition does not hold.
        timeout_s: seconds before giving up.
        what: what is waited for, named in the failure.
        alive: a ``subprocess.Popen`` or an object with ``.proc`` (and optionally ``.log()``
            and ``.log_path``) whose exit ends the wait at once with its log's tail.

    Raises:
        AssertionError: naming ``what`` after ``timeout_s``, or when ``alive`` exited.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        _check_alive(alive, what)
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(every_s)


def _check_alive(alive: Any, what: str) -> None:
    if alive is None:
        return
    proc = alive if isinstance(alive, subprocess.Popen) else alive.proc
    if proc.poll() is None:
        return
    tail = ""
    if hasattr(alive, "log"):
        tail = ":\n" + alive.log()[-4000:]
    name = getattr(getattr(alive, "log_path", None), "name", "the process")
    raise AssertionError(f"{what}: {name} exited {proc.returncode}{tail}")


def seconds_until(probe: Callable[[], Any], timeout_s: float = 20.0, what: str = "condition",
                  alive: Any = None, every_s: float = POLL_S) -> float:
    """:func:`wait_for`, timed: the seconds until ``probe`` held (for tests whose claim is how
    soon something happens)."""
    start = time.monotonic()
    wait_for(probe, timeout_s, what, alive, every_s)
    return time.monotonic() - start
