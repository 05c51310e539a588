"""Reporting a wait for a rollout node: console lines every few seconds (a fake clock), and
``GetRunStatus.node_wait`` over a real TrainerService while it lasts: the pool's ``on_wait``
as the run wires it, a ``NodeWaitChanged`` event through the reporter to the console and
status subscribers."""

from __future__ import annotations

from collections.abc import Callable

from gridrl.common.rpc.channel import dial
from gridrl.trainer.fleet.pool import NodeWait
from gridrl.trainer.report.console import ConsoleLines
from gridrl.trainer.report.events import NodeWaitChanged
from gridrl.trainer.report.reporter import Reporter
from gridrl.trainer.report.status import RunStatus, StatusSubscriber
from gridrl.trainer.server import serve_trainer
from gridrl.v1 import trainer_pb2, trainer_pb2_grpc


class Console:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def print(self, line: str) -> None:
        self.lines.append(line)


def on_wait(console: Console, status: RunStatus | None, every_s: float,
                     clock: Callable[[], float],
                     stopping: Callable[[], bool] = lambda: False
                     ) -> Callable[[NodeWait | None], None]:
    """The pool's ``on_wait`` of a run (``build_run``): each wait becomes an event."""
    reporter = Reporter()
    reporter.subscribe(ConsoleLines(console, total_steps=10, remote=True, wait_every_s=every_s,
                                    clock=clock))
    if status is not None:
        reporter.subscribe(StatusSubscriber(status))
    return lambda wait: reporter.event(NodeWaitChanged(wait, stopping=stopping()))


def test_wait_reported_on_the_console_and_in_get_run_status() -> None:
    status = RunStatus()
    status.begin("run", "/runs/run", total_steps=10, model_id="tiny")
    server = serve_trainer(status, "127.0.0.1:0", metrics_port=-1)
    clock = {"now": 100.0}
    console = Console()
    report = on_wait(console, status, every_s=5.0, clock=lambda: clock["now"])

    def get_status() -> trainer_pb2.GetRunStatusResponse:
        with dial(server.address) as channel:
            return trainer_pb2_grpc.TrainerServiceStub(channel).GetRunStatus(
                trainer_pb2.GetRunStatusRequest(), timeout=10)

    try:
        assert not get_status().HasField("node_wait")
        waiting_for = "127.0.0.1:5001 (benched: 3 consecutive Generate failures)"
        for t, waited in ((100.0, 0.0), (102.0, 2.0), (104.9, 4.9), (105.0, 5.0), (111.0, 11.0)):
            clock["now"] = t
            report(NodeWait(waited_s=waited, left_s=300.0 - waited, waiting_for=waiting_for))
        # a line when the wait begins, then one every 5 s
        assert len(console.lines) == 3
        assert console.lines[0] == ("[bold yellow]waiting for a rollout node[/] (none in "
                                    "rotation) for 0s, 300s left (--outage-wait-s): "
                                    + waiting_for)
        assert "for 5s, 295s left" in console.lines[1] and "for 11s, 289s left" in console.lines[2]
        wait = get_status().node_wait
        assert (wait.waiting_for, wait.waited_s, wait.left_s) == (waiting_for, 11.0, 289.0)

        report(None)  # a node is back
        assert console.lines[-1] == ("[bold green]a rollout node is back[/] after waiting 11s; "
                                     "going on")
        assert not get_status().HasField("node_wait")
        report(None)  # a second end says nothing more
        assert len(console.lines) == 4
    finally:
        server.stop(grace_s=0)


def test_the_starts_wait_names_min_nodes_and_node_wait_s() -> None:
    """The start's wait for --min-nodes (NodeWait.starting) reads as such, names its own flag
    (--start-wait-s), and ends with 'ready', not 'back'."""
    clock = {"now": 0.0}
    console = Console()
    report = on_wait(console, None, every_s=5.0, clock=lambda: clock["now"])
    what = "master 127.0.0.1:50050 (UNAVAILABLE: failed to connect to all addresses)"
    report(NodeWait(waited_s=0.0, left_s=120.0, waiting_for=what, starting=True,
                    in_rotation=1, needed=2))
    clock["now"] = 7.0
    report(None)
    assert console.lines == [
        "[bold yellow]waiting for 2 rollout node(s)[/] (1 ready) for 0s, 120s left "
        "(--start-wait-s): " + what,
        "[bold green]rollout node(s) ready[/] after waiting 0s"]


def test_a_wait_ended_by_a_stop_says_so() -> None:
    """SIGTERM during the wait ends it: the line says the run stops, not that nodes are ready."""
    console = Console()
    stopping = {"now": False}
    report = on_wait(console, None, every_s=5.0, clock=lambda: 0.0,
                              stopping=lambda: stopping["now"])
    report(NodeWait(waited_s=39.0, left_s=81.0, waiting_for="none", starting=True,
                    in_rotation=0, needed=1))
    stopping["now"] = True
    report(None)
    assert console.lines[-1] == ("[bold yellow]stopped waiting for rollout nodes[/] after 39s: "
                                 "the run was asked to stop")


def test_a_start_wait_that_times_out_never_says_ready(reserved_port) -> None:
    """A wrong address: nothing answers there. The start's wait (a real pool, a real channel
    to a port nobody serves) runs out: the console says it gave up, naming the flag, never
    'ready'; GetRunStatus' node_wait is cleared; the run gets the TimeoutError."""
    import pytest
    from scripted_nodes import BASE

    from gridrl.trainer.fleet.pool import NodePool

    console = Console()
    status = RunStatus()
    report = on_wait(console, status, every_s=5.0, clock=lambda: 0.0)
    pool = NodePool(master=None, addresses=[f"127.0.0.1:{reserved_port}"],
                    model_identity=BASE, probe_interval_s=0.2, on_wait=report)
    pool.start()
    try:
        with pytest.raises(TimeoutError, match=r"--start-wait-s"):
            pool.wait_for_nodes(1, timeout_s=1.5)
    finally:
        pool.close()
    assert not any("node(s) ready" in line for line in console.lines), console.lines
    assert console.lines[-1].startswith("[bold red]gave up waiting for 1 rollout node(s) "
                                        "(0 ready)[/] after ")
    assert "(--start-wait-s): 127.0.0.1:" in console.lines[-1]
    assert not status.snapshot().HasField("node_wait")
