"""A newcomer's common mistakes end in one line naming the flag and what to do, with no
traceback, before any model loads or server binds (issue 20): a ``--model`` typo, a
``--master`` without a port or with a URL scheme, an address where another gridrl service
answers, a port already in use, a missing task file. Exit status 2 (click's usage error).

The commands run in-process through click's CliRunner; the services at the addresses are real
(a TrainerService on a free port, a socket holding a port)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from gridrl.master.cli import main as master_cli
from gridrl.rollout.cli import main as rollout_cli
from gridrl.trainer.cli import main as trainer_cli
from gridrl.trainer.server import serve_trainer
from gridrl.trainer.status import RunStatus
from gridrl.trainer.tasks import WORD_BANK


def error_line(result: Result) -> str:
    """The one line that says what is wrong (click prints usage lines above it)."""
    assert "Traceback" not in result.output, result.output
    lines = [ln for ln in result.output.splitlines() if ln.lower().startswith("error")]
    assert len(lines) == 1, result.output
    return lines[0]


@pytest.fixture
def trainer_service() -> Iterator[str]:
    """A real TrainerService (the wrong service for --master / --address)."""
    server = serve_trainer(RunStatus(), "127.0.0.1:0", metrics_port=-1)
    try:
        yield server.address
    finally:
        server.stop(grace_s=0)


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port another process listens on (not a gridrl service)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def trainer_run(tmp_path: Path, *args: str) -> Result:
    ready = tmp_path / "ready.json"
    result = CliRunner().invoke(trainer_cli, [
        "run", "--run-dir", str(tmp_path / "run"), "--listen", "127.0.0.1:0",
        "--metrics-port", "-1", "--ready-file", str(ready), *args])
    assert result.exit_code == 2, result.output
    assert not ready.exists(), "the server bound before the input was checked"
    assert not (tmp_path / "run").exists(), "a run directory was left behind"
    return result


def test_model_typo_suggests_the_alias_at_once(tmp_path: Path) -> None:
    result = trainer_run(tmp_path, "--model", "smollm2-135m-instuct")
    assert error_line(result) == (
        "Error: --model: 'smollm2-135m-instuct' is not an alias, a local directory or a hub id "
        "(org/name); did you mean 'smollm2-135m-instruct'?")
    node = CliRunner().invoke(rollout_cli, ["serve", "--listen", "127.0.0.1:0",
                                            "--metrics-port", "-1", "--model", "smollm2-135M"])
    assert node.exit_code == 2, node.output
    assert error_line(node) == (
        "Error: Invalid value for --model: 'smollm2-135M' is not an alias, a local directory "
        "or a hub id (org/name); did you mean 'smollm2-135m-instruct'?")
    missing = trainer_run(tmp_path, "--model", "./no-such-model")
    assert error_line(missing) == "Error: --model: directory './no-such-model' does not exist"


@pytest.mark.parametrize(("master", "line"), [
    ("127.0.0.1", "Error: --master: '127.0.0.1' is not host:port: the port is missing "
                  "(give 127.0.0.1:PORT)"),
    ("http://127.0.0.1:50050", "Error: --master: 'http://127.0.0.1:50050' is not host:port: "
                               "drop the http:// (give 127.0.0.1:50050)"),
])
def test_master_must_be_host_and_port(tmp_path: Path, master: str, line: str) -> None:
    assert error_line(trainer_run(tmp_path, "--master", master)) == line
    node = CliRunner().invoke(rollout_cli, ["serve", "--listen", "127.0.0.1:0",
                                            "--metrics-port", "-1", "--master", master])
    assert node.exit_code == 2, node.output
    assert error_line(node) == line.replace("Error: --master: ",
                                            "Error: Invalid value for --master: ")


def test_another_service_at_master_is_named(tmp_path: Path, trainer_service: str) -> None:
    result = trainer_run(tmp_path, "--master", trainer_service)
    assert error_line(result) == (f"Error: --master: {trainer_service} is a trainer "
                                  "(gridrl-trainer run), not the master (gridrl-master serve)")
    rollout = trainer_run(tmp_path, "--rollout", trainer_service)
    assert error_line(rollout) == (f"Error: --rollout: {trainer_service} is a trainer "
                                   "(gridrl-trainer run), not a rollout node "
                                   "(gridrl-rollout serve)")
    node = CliRunner().invoke(rollout_cli, ["serve", "--listen", "127.0.0.1:0",
                                            "--metrics-port", "-1", "--master", trainer_service])
    assert node.exit_code == 2, node.output
    assert error_line(node) == (f"Error: Invalid value for --master: {trainer_service} is a "
                                "trainer (gridrl-trainer run), not the master "
                                "(gridrl-master serve)")
    # a client command: the call fails UNIMPLEMENTED, and the line says what is there
    listing = CliRunner().invoke(master_cli, ["nodes", "--master", trainer_service,
                                              "--timeout-s", "10"])
    assert listing.exit_code == 1, listing.output
    assert error_line(listing) == (f"error: UNIMPLEMENTED: Method not found! ({trainer_service} "
                                   "is a trainer (gridrl-trainer run): check the address)")


def test_ports_in_use_name_the_flag(tmp_path: Path, taken_port: int,
                                    trainer_service: str) -> None:
    result = CliRunner().invoke(trainer_cli, [
        "run", "--run-dir", str(tmp_path / "run"), "--listen", "127.0.0.1:0",
        "--metrics-port", str(taken_port)])
    assert result.exit_code == 2, result.output
    assert error_line(result) == (
        f"Error: Invalid value for --metrics-port: port {taken_port} is already in use on "
        "127.0.0.1; give another port (0: any free port, -1: no metrics)")
    listen = CliRunner().invoke(rollout_cli, ["serve", "--listen", trainer_service,
                                              "--metrics-port", "-1"])
    assert listen.exit_code == 2, listen.output
    assert error_line(listen) == (
        f"Error: Invalid value for --listen: {trainer_service} is already in use by a "
        "trainer (gridrl-trainer run); stop it or give another port (0: any free port)")
    assert not (tmp_path / "run").exists()


def test_missing_task_file_before_the_model_loads(tmp_path: Path) -> None:
    task = tmp_path / "tasks.jsonl"
    result = trainer_run(tmp_path, "--task", str(task))
    assert error_line(result) == (f"Error: --task: '{task}': no such file (give "
                                  "'reverse-words' or a JSONL file with prompt/answer columns)")
    task.write_text('{"prompt": "a", "answer": "a"}\n')
    reward = trainer_run(tmp_path, "--task", str(task), "--reward-file", "rewards.py")
    assert error_line(reward) == "Error: --reward-file: 'rewards.py': no such file"
    unknown = trainer_run(tmp_path, "--task", "reverse-word")
    assert error_line(unknown) == ("Error: --task: 'reverse-word': not a task name or a file "
                                   "(give 'reverse-words' or a JSONL file with prompt/answer "
                                   "columns)")
    words = trainer_run(tmp_path, "--min-words", "5", "--max-words", "2")
    assert error_line(words) == ("Error: --min-words/--max-words: need 2 <= min <= max <= "
                                 f"{len(WORD_BANK)}, got 5..2")
