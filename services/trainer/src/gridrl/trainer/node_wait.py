"""Telling the operator that the run waits for a rollout node: console and GetRunStatus.

    reporter = NodeWaitReporter(console, status)
    pool = NodePool(..., wait_for_nodes_s=300, on_wait=reporter)

The pool calls the reporter about every half second while a batch waits for a node (none in
rotation), or the start waits for ``--min-nodes`` nodes, and once with None when the wait ends; the reporter prints a line when the wait
begins and every ``every_s`` seconds after — what it waits for and how long is left — sets
``GetRunStatusResponse.node_wait`` for as long as it lasts, and prints how long it took when a
node is back. (The ``gridrl_trainer_node_wait_*`` gauges are the pool's.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gridrl.trainer.pool import NodeWait


class NodeWaitReporter:
    """``on_wait`` callback of a :class:`~gridrl.trainer.pool.NodePool`.

    Args:
        console: a ``rich`` console (or anything with ``print``).
        status: the run's :class:`~gridrl.trainer.status.RunStatus`, or None.
        every_s: seconds between console lines while the wait lasts.
        clock: monotonic seconds (tests pass a fake).
        stopping: True once the run was asked to stop (a wait it ends is not "ready").
    """

    def __init__(self, console: Any, status: Any | None = None, every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic,
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self.console = console
        self.status = status
        self.every_s = every_s
        self._clock = clock
        self._stopping = stopping
        self._printed_at: float | None = None
        self._last: NodeWait | None = None

    def __call__(self, wait: NodeWait | None) -> None:
        if wait is None:
            last = self._last
            if last is not None and self._stopping():
                self.console.print(f"[bold yellow]stopped waiting for rollout nodes[/] after "
                                   f"{last.waited_s:.0f}s: the run was asked to stop")
            elif last is not None and last.starting:
                self.console.print(f"[bold green]rollout node(s) ready[/] after waiting "
                                   f"{last.waited_s:.0f}s")
            elif last is not None:
                self.console.print(f"[bold green]a rollout node is back[/] after waiting "
                                   f"{last.waited_s:.0f}s; going on")
            self._last = self._printed_at = None
            if self.status is not None:
                self.status.set_node_wait(None)
            return
        self._last = wait
        if self.status is not None:
            self.status.set_node_wait(wait.waiting_for, wait.waited_s, wait.left_s)
        now = self._clock()
        if self._printed_at is None or now - self._printed_at >= self.every_s:
            self._printed_at = now
            if wait.starting:
                self.console.print(
                    f"[bold yellow]waiting for {wait.needed} rollout node(s)[/] "
                    f"({wait.in_rotation} ready) for {wait.waited_s:.0f}s, {wait.left_s:.0f}s "
                    f"left (--node-wait-s): {wait.waiting_for}")
            else:
                self.console.print(
                    f"[bold yellow]waiting for a rollout node[/] (none in rotation) for "
                    f"{wait.waited_s:.0f}s, {wait.left_s:.0f}s left (--wait-for-nodes-s): "
                    f"{wait.waiting_for}")
