"""The README's by-hand commands, run literally in a fresh shell: a login environment with no
activated venv (``PATH`` of the system only, a new ``HOME``), from a directory whose
``.venv`` is this checkout's venv, as a user who ran ``make install`` in the repository root.

What the test changes, and only that: ports (each README port becomes a reserved loopback port,
the metrics ports and the listen defaults come from ``GRIDRL_*`` variables so parallel runs do
not collide), host names (each ``*.lan`` machine is a loopback address of its own,
127.0.0.2, .3, ...: one machine plays them all, and they keep distinct addresses, as the node
credentials bound to them must), the model (the tiny llama instead of the bundled SmolLM2: in the node's ``--model`` and
the trainer's ``GRIDRL_TRAINER_MODEL``) and the step budget (2 steps).
The blocks are found by the HTML comment that precedes them in README.md
(``<!-- one-machine -->``, ``<!-- cluster-certs -->``, ``<!-- cluster-credentials -->``,
``<!-- cluster-run -->``). The trainer is started before the node so that its TrainerService
answers ``gridrl-trainer status`` while it waits for one, then the node joins and the run
finishes its steps."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parent.parent
README_PORTS = ("50050", "50051", "50052")  # master, rollout node, trainer
SERVICES = ("MASTER", "ROLLOUT", "TRAINER")


class HeldPorts:
    """Three loopback ports (master, node, trainer), each held by a bound, never listening
    socket until :meth:`release` lets its server bind it (as ``conftest.reserved_port``)."""

    def __init__(self) -> None:
        self._socks = [socket.socket() for _ in README_PORTS]
        for sock in self._socks:
            sock.bind(("127.0.0.1", 0))
        self.ports = [sock.getsockname()[1] for sock in self._socks]

    def release(self, i: int) -> None:
        self._socks[i].close()

    def close(self) -> None:
        for sock in self._socks:
            sock.close()


def readme_block(marker: str) -> str:
    """The code block right after ``<!-- marker -->`` in README.md."""
    found = re.search(rf"<!-- {marker} -->\n```\n(.*?)```", (REPO / "README.md").read_text(),
                      re.S)
    assert found, f"README.md has no block marked <!-- {marker} -->"
    return found.group(1)


def shell_lines(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", "", block)
    return [line for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def fresh_env(home: Path, model: Path) -> dict[str, str]:
    """A new login shell's environment: no venv on PATH, nothing of this process's, a new
    HOME (holding only the compiled CPU kernels of this machine's cache). Only the metrics
    ports (any free one), the trainer's default model (the tiny llama, as the node's
    ``--model``), one torch thread per process (a shared 2-core machine) and a longer wait for
    the node (started after the trainer here, it may take a minute to import on a loaded
    machine; the default 120 s is for a node that is already up) are added."""
    home.mkdir(exist_ok=True)
    # the fused CPU kernels compiled once on this machine, as any earlier run leaves them
    # (compiling them again costs a minute on a loaded 2-core machine)
    from gridrl.models import cache_root

    if (cache_root() / "kernels").is_dir():
        shutil.copytree(cache_root() / "kernels", home / ".cache" / "gridrl" / "kernels")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "GRIDRL_TRAINER_MODEL": str(model),
           "GRIDRL_TRAINER_NODE_WAIT_S": "600"}
    env.update({f"GRIDRL_{s}_METRICS_PORT": "0" for s in SERVICES})
    return env


_LAN = re.compile(r"\b[\w-]+\.lan\b")


def lan_hosts() -> dict[str, str]:
    """Each ``*.lan`` machine of the README, in order of first mention, as its own loopback
    address (127.0.0.2, 127.0.0.3, ...; all of 127/8 reaches this machine on Linux)."""
    names = dict.fromkeys(_LAN.findall((REPO / "README.md").read_text()))
    return {name: f"127.0.0.{i + 2}" for i, name in enumerate(names)}


def on_loopback(text: str, ports: list[int], model: Path) -> str:
    """The README's text for one machine: each ``*.lan`` -> its loopback address
    (:func:`lan_hosts`), README ports -> ``ports``, the bundled model -> the tiny llama,
    ``--steps N`` -> ``--steps 2``."""
    hosts = lan_hosts()
    text = _LAN.sub(lambda m: hosts[m.group()], text)
    for readme_port, port in zip(README_PORTS, ports, strict=True):
        text = re.sub(rf":{readme_port}\b", f":{port}", text)
    text = text.replace("smollm2-135m-instruct", str(model))
    return re.sub(r"--steps \d+", "--steps 2", text)


class Shell:
    """Runs README lines with ``bash`` in ``cwd`` under ``env``; starts servers in the
    background (``exec``: the signal reaches the service itself) and stops them at the end."""

    def __init__(self, cwd: Path, env: dict[str, str], prelude: str = "") -> None:
        self.cwd, self.env, self.prelude = cwd, env, prelude
        self.started: list[subprocess.Popen] = []

    def run(self, script: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-euo", "pipefail", "-c", self.prelude + script],
                              cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def start(self, line: str, name: str) -> subprocess.Popen:
        log = (self.cwd / f"{name}.log").open("w")
        proc = subprocess.Popen(["bash", "-c", f"{self.prelude}exec {line}"], cwd=self.cwd,
                                env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.started.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.cwd / f"{name}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def shell_factory(tmp_path: Path) -> Iterator[Callable[..., Shell]]:
    shells: list[Shell] = []

    def factory(env: dict[str, str], prelude: str = "") -> Shell:
        shells.append(Shell(tmp_path / "work", env, prelude))
        return shells[-1]

    (tmp_path / "work").mkdir()
    (tmp_path / "work" / ".venv").symlink_to(VENV)  # the repository root's .venv, as made by
    yield factory                                     # `make install`
    for shell in shells:
        shell.stop_all()


def wait_for_log(shell: Shell, name: str, line: str, alive: list[subprocess.Popen],
                 timeout: float = 180) -> None:
    """Wait until ``name``'s log has ``line`` (cheap: no process started while the services,
    slow to import on a loaded machine, come up); fail at once if a server died."""
    deadline = time.monotonic() + timeout
    while line not in shell.log(name):
        for proc in alive:
            assert proc.poll() is None, f"exited {proc.returncode} before {line!r}:\n" + \
                shell.log(name)
        assert time.monotonic() < deadline, f"no {line!r} in {timeout} s:\n" + shell.log(name)
        time.sleep(0.3)


def answers(shell: Shell, line: str, ok: Callable[[str], bool], what: str,
            tries: int = 10) -> str:
    """Run the README ``line`` until it exits 0 with ``ok(stdout)`` (a few tries: a service
    logs that it serves just before its state is filled in)."""
    for _ in range(tries):
        got = shell.run(line)
        if got.returncode == 0 and ok(got.stdout):
            return got.stdout
        time.sleep(1)
    pytest.fail(f"{what}: exit {got.returncode}\n{got.stdout}{got.stderr}")


def run_the_cluster(shell: Shell, lines: list[str], ports: HeldPorts,
                    node_address: str) -> None:
    """Start the master, then the trainer (it waits for a node; ``status`` answers), then the
    node (``nodes`` lists it), and let the trainer finish its 2 steps; then SIGTERM the node
    and the master, which exit 0."""
    by_role = {role: [line for line in lines if f"/gridrl-{role}" in line] for role in
               ("master serve", "rollout serve", "trainer run", "master nodes",
                "trainer status")}
    assert all(len(v) == 1 for v in by_role.values()), by_role
    assert len(lines) == 5 + sum(bool(re.match(r"[A-Z]+=", line)) for line in lines), lines
    command = {role: v[0] for role, v in by_role.items()}

    ports.release(0)
    master = shell.start(command["master serve"], "master")
    wait_for_log(shell, "master", "serving gridrl.v1.RegistryService", [master])
    listed = answers(shell, command["master nodes"], lambda out: True, "gridrl-master nodes")
    assert "0 node(s)" in listed, listed
    ports.release(2)
    trainer = shell.start(command["trainer run"], "trainer")
    wait_for_log(shell, "trainer", "serving gridrl.v1.TrainerService", [master, trainer])
    status = answers(shell, command["trainer status"], lambda out: "0/2" in out,
                     "gridrl-trainer status, waiting for a node")
    assert "step" in status, status
    ports.release(1)
    node = shell.start(command["rollout serve"], "node")
    wait_for_log(shell, "master", f"registered {node_address}", [master, trainer, node])
    listed = answers(shell, command["master nodes"], lambda out: node_address in out,
                     f"gridrl-master nodes lists {node_address}")
    # one rollout node (a trainer given --master lists itself too, with role trainer: its
    # trainer-scoped credential may register a trainer entry)
    assert re.search(rf"{re.escape(node_address)}\s+rollout\s", listed), listed
    assert len(re.findall(r"\srollout\s", listed)) == 1, listed
    try:
        assert trainer.wait(300) == 0, shell.log("trainer")
    except subprocess.TimeoutExpired:
        pytest.fail("the trainer did not finish 2 steps in 300 s:\n" + shell.log("trainer"))
    (run_dir,) = (shell.cwd / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2, summary
    last = json.loads((run_dir / "log.jsonl").read_text().splitlines()[-1])
    assert (last["policy_version"], last["synced_nodes"]) == (2, [node_address]), last
    for proc, name in ((node, "node"), (master, "master")):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, shell.log(name)


@pytest.fixture
def held_ports() -> Iterator[HeldPorts]:
    ports = HeldPorts()
    yield ports
    ports.close()


@pytest.mark.slow
def test_the_readme_one_machine_commands_train(shell_factory, held_ports: HeldPorts,
                                               tiny_llama_dir: Path, tmp_path: Path) -> None:
    ports = held_ports.ports
    env = fresh_env(tmp_path / "home", tiny_llama_dir)
    # the servers' default --listen, moved to the held ports
    env.update({f"GRIDRL_{s}_LISTEN": f"127.0.0.1:{p}" for s, p in zip(SERVICES, ports,
                                                                      strict=True)})
    lines = shell_lines(on_loopback(readme_block("one-machine"), ports, tiny_llama_dir))
    assert not any("--listen" in line for line in lines), lines  # the defaults: loopback
    run_the_cluster(shell_factory(env), lines, held_ports, f"127.0.0.1:{ports[1]}")


@pytest.mark.slow
def test_the_readme_multi_machine_commands_train_over_mutual_tls(
        shell_factory, held_ports: HeldPorts, tiny_llama_dir: Path, tmp_path: Path) -> None:
    ports = held_ports.ports
    env = fresh_env(tmp_path / "home", tiny_llama_dir)
    bare = shell_factory(env)
    for marker in ("cluster-certs", "cluster-credentials"):
        done = bare.run(on_loopback(readme_block(marker), ports, tiny_llama_dir))
        assert done.returncode == 0, (marker, done.stderr)
    work = bare.cwd
    assert {"ca.crt", "ca.key", "master.crt", "gpu-box-1.key", "trainer.crt", "ops.crt"} <= \
        {p.name for p in (work / "certs").iterdir()}
    assert {"gpu-box-1.token", "trainer.token", "ops.token", "authorized_tokens"} <= \
        {p.name for p in work.iterdir()}
    from gridrl.common.auth import AuthorizedTokens, certificate_file_fingerprint

    trainer = AuthorizedTokens(work / "authorized_tokens").lookup(
        (work / "trainer.token").read_text().strip())
    assert trainer.cert == certificate_file_fingerprint(work / "certs" / "trainer.crt")

    block = shell_lines(on_loopback(readme_block("cluster-run"), ports, tiny_llama_dir))
    prelude = "".join(line + "\n" for line in block if re.match(r"[A-Z]+=", line))
    assert all(("--listen 0.0.0.0:" in line and "--tls-cert" in line)
               for line in block if " serve " in line or " run " in line), block
    run_the_cluster(shell_factory(env, prelude), block, held_ports,
                    f"{lan_hosts()['gpu-box-1.lan']}:{ports[1]}")
