"""Test-only pause points: a process stops at a named point so a fault test can kill it there.

    pause_point("trainer.checkpoint")                 # no-op unless armed
    requests = pause_in_stream(requests, "trainer.push")   # pauses after the first message

**For tests only**; nothing sets these variables outside ``tests/faults``:

- ``GRIDRL_TEST_PAUSE_AT=<point>[:<n>]`` arms ``<point>``: the ``n``-th time the process
  reaches it (default the first), it pauses;
- ``GRIDRL_TEST_PAUSE_FILE=<path>``: written (JSON ``{"point", "hit", "pid"}``, atomically)
  when the process pauses, so the test knows, without sleeping, that the process is exactly
  there; the pausing thread then blocks for good (the test kills the process, e.g. SIGKILL).

Points: ``trainer.push`` (a PushAdapter stream, after its first message), ``trainer.checkpoint``
(a checkpoint directory written, ``latest`` not yet updated), ``rollout.generate`` (a Generate
submitted to the engine, its answer not yet sent), ``rollout.push`` (a PushAdapter stream,
after its header was read).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")

ENV_AT = "GRIDRL_TEST_PAUSE_AT"
ENV_FILE = "GRIDRL_TEST_PAUSE_FILE"

_lock = threading.Lock()
_hits: dict[str, int] = {}


def armed(point: str) -> bool:
    """Whether ``GRIDRL_TEST_PAUSE_AT`` names ``point``."""
    return os.environ.get(ENV_AT, "").split(":")[0] == point


def pause_point(point: str) -> None:
    """Pause here for good when ``point`` is armed and this is its ``n``-th hit (see the
    module docstring); return at once otherwise."""
    if not armed(point):
        return
    spec = os.environ[ENV_AT]
    nth = int(spec.split(":")[1]) if ":" in spec else 1
    with _lock:
        hit = _hits[point] = _hits.get(point, 0) + 1
    if hit != nth:
        return
    path = os.environ.get(ENV_FILE)
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"point": point, "hit": hit, "pid": os.getpid()}, f)
        os.replace(tmp, path)
    threading.Event().wait()  # until the test kills the process


def pause_in_stream(messages: Iterator[T], point: str, after: int = 1) -> Iterator[T]:
    """``messages`` unchanged, or, when ``point`` is armed, a stream that reaches the pause
    point after its first ``after`` messages went through."""
    if not armed(point):
        return messages

    def paused() -> Iterator[T]:
        for i, message in enumerate(messages):
            yield message
            if i + 1 == after:
                pause_point(point)

    return paused()
