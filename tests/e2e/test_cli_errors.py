"""A newcomer's common mistakes end in one line naming the flag and what to do, with no
traceback, before any model loads or server binds (issue 20): a ``--model`` typo, a
``--master`` without a port or with a URL scheme, an address where another gridrl service
answers, a port already in use, a missing task file. Exit status 2 (click's usage error).

The commands run in-process through click's CliRunner; the services at the addresses are real
(a TrainerService on a free port, a socket holding a port)."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from gridrl.common.auth_cli import main as auth_cli
from gridrl.master.cli import main as master_cli
from gridrl.rollout.cli import main as rollout_cli
from gridrl.trainer.cli import main as trainer_cli
from gridrl.trainer.envs.reverse import WORD_BANK
from gridrl.trainer.report.status import RunStatus
from gridrl.trainer.server import serve_trainer


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


@pytest.mark.parametrize(("cli", "args", "flag"), [
    (master_cli, ["nodes", "--master"], "--master"),
    (master_cli, ["nodes", "--address"], "--master"),
    (rollout_cli, ["generate", "--prompt", "a", "--address"], "--address"),
    (rollout_cli, ["info", "--address"], "--address"),
    (rollout_cli, ["reload-adapter", "--address"], "--address"),
    (rollout_cli, ["push-adapter", ".", "--address"], "--address"),
    (trainer_cli, ["status", "--address"], "--address"),
    (auth_cli, ["mint", "--authorized-tokens", "t", "--scope", "node", "--id", "n",
                "--address"], "--address"),
])
def test_every_address_flag_is_host_and_port(cli, args: list[str], flag: str) -> None:
    """A client command given a bare host fails in one line naming its flag before it dials
    anything (gRPC would dial port 443 and wait for its deadline); so does a URL."""
    import time

    start = time.monotonic()
    bare = CliRunner().invoke(cli, [*args, "127.0.0.1"])
    assert bare.exit_code == 2, bare.output
    assert error_line(bare) == (f"Error: Invalid value for {flag}: '127.0.0.1' is not "
                                "host:port: the port is missing (give 127.0.0.1:PORT)")
    url = CliRunner().invoke(cli, [*args, "http://node.lan:50051"])
    assert url.exit_code == 2, url.output
    assert error_line(url) == (f"Error: Invalid value for {flag}: 'http://node.lan:50051' is "
                               "not host:port: drop the http:// (give node.lan:50051)")
    assert time.monotonic() - start < 5  # no connection attempt, no deadline waited out


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


def test_missing_task_file_before_the_model_loads(tmp_path: Path, monkeypatch) -> None:
    task = tmp_path / "tasks.jsonl"
    result = trainer_run(tmp_path, "--task", str(task))
    assert error_line(result) == f"Error: --task: {task}: no such file"
    task.write_text('{"prompt": "a", "answer": "a"}\n')
    reward = trainer_run(tmp_path, "--task", str(task), "--reward-file", "rewards.py")
    assert error_line(reward) == "Error: --reward-file: 'rewards.py': no such file"
    few = trainer_run(tmp_path, "--task", str(task))
    assert error_line(few) == (f"Error: --task: {task}: 1 rows, need more than "
                               "--eval-tasks=16 to hold out")
    unknown = trainer_run(tmp_path, "--task", "reverse-word")
    assert error_line(unknown) == (
        "Error: --task: 'reverse-word' is none of reverse-words, reverse-words-retry, "
        "tool-arithmetic, reasoning-gym:<dataset>, verifiers:<environment>, a .py file or a "
        ".jsonl file")
    dataset = trainer_run(tmp_path, "--task", "reasoning-gym:spell_backwards")
    assert error_line(dataset).startswith(
        "Error: --task: reasoning-gym has no dataset 'spell_backwards'")
    params = trainer_run(tmp_path, "--task", "reasoning-gym:spell_backward",
                         "--task-params", "min_word_len")
    assert error_line(params) == "Error: --task-params: 'min_word_len' is not key=value"
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # the extra not installed
    extra = trainer_run(tmp_path, "--task", "reasoning-gym:spell_backward")
    assert error_line(extra) == (
        "Error: --task: reasoning-gym is not installed: pip install "
        "'gridrl-trainer[reasoning-gym]' (or pip install reasoning-gym==0.1.25)")
    env_file = tmp_path / "env.py"
    env_file.write_text("x = 1\n")
    no_env = trainer_run(tmp_path, "--task", str(env_file))
    assert error_line(no_env) == (f"Error: --task: {env_file}: defines 0 Environment "
                                  "subclasses; set ENVIRONMENT = <the one to run>")
    words = trainer_run(tmp_path, "--min-words", "5", "--max-words", "2")
    assert error_line(words) == ("Error: --min-words/--max-words: need 2 <= min <= max <= "
                                 f"{len(WORD_BANK)}, got 5..2")


def test_an_environment_file_s_syntax_error_and_an_unknown_task_param_are_one_line(
        tmp_path: Path) -> None:
    """A syntax error in a ``--task`` file is FILE:LINE:COL and the message (not a repr
    tuple); a ``--task-params`` key the dataset lacks names the keys it has."""
    env_file = tmp_path / "env.py"
    env_file.write_text("import os\n\nclass Env(:\n    pass\n")
    syntax = trainer_run(tmp_path, "--task", str(env_file))
    assert error_line(syntax) == (f"Error: --task: {env_file}:3:11: import failed: "
                                  "SyntaxError: invalid syntax: 'class Env(:'")
    pytest.importorskip("reasoning_gym")
    key = trainer_run(tmp_path, "--task", "reasoning-gym:spell_backward", "--task-params",
                      "min_len=3")
    assert error_line(key) == ("Error: --task-params: spell_backward has no parameter "
                               "'min_len'; its parameters: min_word_len, max_word_len, "
                               "data_file")


def test_a_verifiers_task_names_what_to_install_before_the_model_loads(tmp_path: Path,
                                                                     monkeypatch) -> None:
    """``--task verifiers:<taskset>``: an uninstalled taskset package or a missing extra is
    one line (naming what to install) before the model loads."""
    pytest.importorskip("verifiers.v1")
    unknown = trainer_run(tmp_path, "--task", "verifiers:no-such-taskset")
    assert error_line(unknown).startswith(
        "Error: --task: no verifiers taskset 'no-such-taskset' is installed (pip install its "
        "package)")
    monkeypatch.setitem(sys.modules, "verifiers", None)  # the extra not installed
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    extra = trainer_run(tmp_path, "--task", "verifiers:no-such-taskset")
    assert error_line(extra) == (
        "Error: --task: verifiers is not installed: pip install 'gridrl-trainer[verifiers]' "
        "(verifiers 0.4.x)")


def _no_hub_env(tmp_path: Path, closed_port: int) -> dict[str, str]:
    """An environment whose hub is a loopback port nobody listens on (what no network looks
    like, decided at once) and whose Hugging Face cache is empty."""
    import os

    return {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{closed_port}",
            "HF_HUB_CACHE": str(tmp_path / "hf-cache"), "HF_HUB_OFFLINE": ""}


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_hub_id_without_network_is_one_line_at_once(tmp_path: Path, closed_port: int) -> None:
    """``--model org/name`` with no hub to reach and no local copy: one line naming the flag
    and the two ways out, from the trainer and the node alike, before anything loads (the
    loader's retries took ~50 s and ended in a 136-line traceback)."""
    import subprocess
    import sys

    env = _no_hub_env(tmp_path, closed_port)
    bin_dir = Path(sys.executable).parent
    message = ("'HuggingFaceTB/SmolLM2-135M-Instruct': no network to reach the hub (127.0.0.1) "
               "and no local copy; use a local directory or the bundled alias "
               "'smollm2-135m-instruct'")
    for command, line in (
            (["gridrl-trainer", "run", "--run-dir", str(tmp_path / "run")],
             f"Error: --model: {message}"),
            (["gridrl-rollout", "serve"], f"Error: Invalid value for --model: {message}")):
        done = subprocess.run([str(bin_dir / command[0]), *command[1:], "--model",
                               "HuggingFaceTB/SmolLM2-135M-Instruct", "--listen", "127.0.0.1:0",
                               "--metrics-port", "-1"], capture_output=True, text=True,
                              env=env, timeout=120)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        assert done.stderr.strip().splitlines()[-1] == line, done.stderr
    assert not (tmp_path / "run").exists()
    # the decision itself (what the process start-up above adds to) takes milliseconds here
    # and at most the 3 s connect timeout where name resolution hangs
    probe = subprocess.run(
        [sys.executable, "-c", "import time; from gridrl.models import check_model\n"
         "start = time.monotonic()\ntry:\n check_model('org/name')\nexcept Exception as e:\n"
         " print(type(e).__name__, round(time.monotonic() - start, 2))"],
        capture_output=True, text=True, env=env, timeout=60)
    kind, seconds = probe.stdout.split()
    assert kind == "ModelNameError" and float(seconds) < 3.5, probe.stdout + probe.stderr


def test_a_hub_id_with_a_local_copy_loads_it_without_network(tmp_path: Path, closed_port: int,
                                                              tiny_llama_dir: Path) -> None:
    """A hub id cached by an earlier download passes the check without network and resolves
    to its snapshot directory, which the loaders read without calling the hub."""
    import shutil
    import subprocess
    import sys

    env = _no_hub_env(tmp_path, closed_port)
    repo = tmp_path / "hf-cache" / "models--org--tiny"
    shutil.copytree(tiny_llama_dir, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    done = subprocess.run(
        [sys.executable, "-c", "from gridrl.models import check_model, resolve_model\n"
         "check_model('org/tiny'); print(resolve_model('org/tiny'))"],
        capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(repo / "snapshots" / "0123abcd")
