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
``<!-- cluster-run -->``, ``<!-- tinker-serve -->``, ``<!-- own-environment -->``...). The trainer is started before the node so that its TrainerService
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
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parent.parent
# master, rollout node, trainer, dashboard, the trainer's Tinker API (serve-api)
README_PORTS = ("50050", "50051", "50052", "8321", "8100")
SERVICES = ("MASTER", "ROLLOUT", "TRAINER")


class HeldPorts:
    """Five loopback ports (master, node, trainer, the master's dashboard, the Tinker API),
    each held by a
    bound, never listening socket until :meth:`release` lets its server bind it (as
    ``conftest.reserved_port``)."""

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

    def logged() -> bool:
        if line in shell.log(name):
            return True
        for proc in alive:
            assert proc.poll() is None, f"exited {proc.returncode} before {line!r}:\n" + \
                shell.log(name)
        return False

    try:
        wait_for(logged, timeout_s=timeout, what=f"{line!r} in {name}'s log", every_s=0.3)
    except AssertionError as e:
        if not str(e).startswith("timed out"):
            raise  # a server exited: the message has its log
        raise AssertionError(f"no {line!r} in {timeout} s:\n" + shell.log(name)) from None


def answers(shell: Shell, line: str, ok: Callable[[str], bool], what: str) -> str:
    """Run the README ``line`` once: it exits 0 with ``ok(stdout)`` (the caller waited for the
    log line that follows the state it asks about)."""
    got = shell.run(line)
    if got.returncode == 0 and ok(got.stdout):
        return got.stdout
    pytest.fail(f"{what}: exit {got.returncode}\n{got.stdout}{got.stderr}")


def run_the_cluster(shell: Shell, lines: list[str], ports: HeldPorts,
                    node_address: str, watch: Callable[[Shell], None] | None = None) -> None:
    """Start the master, then the trainer (it waits for a node; ``status`` answers), then the
    node (``nodes`` lists it), and let the trainer finish its 2 steps; ``watch`` looks at the
    master's dashboard; then SIGTERM the node and the master, which exit 0."""
    by_role = {role: [line for line in lines if f"/gridrl-{role}" in line] for role in
               ("master serve", "rollout serve", "trainer run", "master nodes",
                "trainer status")}
    assert all(len(v) == 1 for v in by_role.values()), by_role
    assert len(lines) == 5 + sum(bool(re.match(r"[A-Z]+=", line)) for line in lines), lines
    command = {role: v[0] for role, v in by_role.items()}

    ports.release(0)
    ports.release(3)  # the dashboard's
    master = shell.start(command["master serve"], "master")
    wait_for_log(shell, "master", "serving gridrl.v1.RegistryService", [master])
    listed = answers(shell, command["master nodes"], lambda out: True, "gridrl-master nodes")
    assert "0 node(s)" in listed, listed
    ports.release(2)
    trainer = shell.start(command["trainer run"], "trainer")
    wait_for_log(shell, "trainer", "serving gridrl.v1.TrainerService", [master, trainer])
    # the run has begun (GetRunStatus has its steps) once it waits for a node
    wait_for_log(shell, "trainer", "rollout node(s) (0 ready)", [master, trainer])
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
    if watch is not None:
        watch(shell)
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
    env.update({f"GRIDRL_{s}_LISTEN": f"127.0.0.1:{p}" for s, p in zip(SERVICES, ports[:3],
                                                                      strict=True)})
    lines = shell_lines(on_loopback(readme_block("one-machine"), ports, tiny_llama_dir))
    assert not any("--listen" in line for line in lines), lines  # the defaults: loopback
    # the master's default dashboard port, 8321 in the README, is the held one here
    (watch_line,) = shell_lines(on_loopback(readme_block("watch-it"), ports, tiny_llama_dir))
    assert watch_line.endswith(f"http://127.0.0.1:{ports[3]}"), watch_line
    node_address = f"127.0.0.1:{ports[1]}"

    def watch(shell: Shell) -> None:
        """The README's one command opens the page: $BROWSER (webbrowser's choice) saves
        what it got; the page's API shows the finished run and the node."""
        page = shell.cwd / "page.html"
        fetch = (f"{sys.executable} -c \"import sys, urllib.request; open('{page}', 'wb')"
                 ".write(urllib.request.urlopen(sys.argv[1]).read())\" %s")
        done = Shell(shell.cwd, {**shell.env, "BROWSER": fetch}, shell.prelude).run(watch_line)
        assert done.returncode == 0, done.stderr
        assert "<title>gridrl</title>" in page.read_text(), page.read_text()[:500]
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[3]}/api/state") as response:
            state = json.loads(response.read())
        assert [(r["state"], r["last_step"]) for r in state["runs"]] == [("finished", 2)]
        assert node_address in {row["address"] for row in state["fleet"]}
        # the plaintext grpcurl lines reach the loopback master: its services, and the node
        listed, nodes = shell_lines(on_loopback(readme_block("grpcurl-loopback"), ports,
                                                tiny_llama_dir))
        done = shell.run(listed)
        assert done.returncode == 0, done.stderr
        assert {"gridrl.v1.RegistryService", "grpc.health.v1.Health"} <= \
            set(done.stdout.split()), done.stdout
        done = shell.run(nodes)
        assert done.returncode == 0, done.stderr
        assert node_address in {n["info"]["address"] for n in json.loads(done.stdout)["nodes"]}

    env["GRIDRL_MASTER_DASHBOARD_PORT"] = str(ports[3])
    run_the_cluster(shell_factory(env), lines, held_ports, node_address, watch)


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
    from gridrl.common.security.tokens import AuthorizedTokens, certificate_file_fingerprint

    trainer = AuthorizedTokens(work / "authorized_tokens").lookup(
        (work / "trainer.token").read_text().strip())
    assert trainer.cert == certificate_file_fingerprint(work / "certs" / "trainer.crt")

    block = shell_lines(on_loopback(readme_block("cluster-run"), ports, tiny_llama_dir))
    prelude = "".join(line + "\n" for line in block if re.match(r"[A-Z]+=", line))
    assert all(("--listen 0.0.0.0:" in line and "--tls-cert" in line)
               for line in block if " serve " in line or " run " in line), block
    node_address = f"{lan_hosts()['gpu-box-1.lan']}:{ports[1]}"

    def watch(shell: Shell) -> None:
        """The README's curl reads the dashboard over mutual TLS with the read credential."""
        (line,) = shell_lines(on_loopback(readme_block("cluster-watch"), ports, tiny_llama_dir))
        done = shell.run(line)
        assert done.returncode == 0, done.stderr
        state = json.loads(done.stdout)
        assert [(r["state"], r["last_step"]) for r in state["runs"]] == [("finished", 2)]
        assert node_address in {row["address"] for row in state["fleet"]}

    env["GRIDRL_MASTER_DASHBOARD_PORT"] = str(ports[3])  # the README's 8321, held here
    run_the_cluster(shell_factory(env, prelude), block, held_ports, node_address, watch)


@pytest.mark.slow
def test_the_readme_tinker_example_runs_on_serve_api(shell_factory, held_ports: HeldPorts,
                                                     tiny_llama_dir: Path,
                                                     tmp_path: Path) -> None:
    """The Tinker API section: a node and ``serve-api`` as written, then the example file with
    the README's environment: it trains, samples on the node's version, and saves the weights
    as peft and mlx-lm directories under ``runs/api``."""
    ports = held_ports.ports
    env = fresh_env(tmp_path / "home", tiny_llama_dir)
    env.update({"GRIDRL_ROLLOUT_LISTEN": f"127.0.0.1:{ports[1]}",
                "GRIDRL_TRAINER_LISTEN": f"127.0.0.1:{ports[2]}",
                "GRIDRL_TRAINER_HTTP_LISTEN": f"127.0.0.1:{ports[4]}", "TINKER_TELEMETRY": "0"})
    shell = shell_factory(env)
    node_line, api_line = shell_lines(on_loopback(readme_block("tinker-serve"), ports,
                                                  tiny_llama_dir))
    held_ports.release(1)
    node = shell.start(node_line, "node")
    wait_for_log(shell, "node", "serving gridrl.v1.RolloutService", [node])
    held_ports.release(2)
    held_ports.release(4)
    api = shell.start(api_line, "serve-api")
    wait_for_log(shell, "serve-api", f"Tinker API on http://127.0.0.1:{ports[4]}", [node, api])
    found = re.search(r"<!-- tinker-hello -->\n```python\n(.*?)```",
                      (REPO / "README.md").read_text(), re.S)
    assert found, "README.md has no python block marked <!-- tinker-hello -->"
    (shell.cwd / "tinker_hello.py").write_text(on_loopback(found.group(1), ports,
                                                           tiny_llama_dir))
    done = shell.run("\n".join(shell_lines(on_loopback(readme_block("tinker-run"), ports,
                                                        tiny_llama_dir))), timeout=600)
    assert done.returncode == 0, done.stderr + shell.log("serve-api")
    losses = [float(x) for x in re.findall(r"step \d: loss ([\d.]+)", done.stdout)]
    assert len(losses) == 5 and losses[-1] < losses[0], done.stdout
    path = done.stdout.strip().splitlines()[-1]
    model, kind, name = path.removeprefix("tinker://").split("/")
    assert (kind, name) == ("sampler_weights", "hello"), path
    saved = shell.cwd / "runs" / "api" / model.replace(":", "-") / "sampler_weights" / "hello"
    assert (saved / "peft" / "adapter_model.safetensors").is_file()
    assert (saved / "mlx" / "adapters.safetensors").is_file()
    for proc, name in ((api, "serve-api"), (node, "node")):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, shell.log(name)


@pytest.mark.slow
def test_the_readme_own_task_runs_as_written(shell_factory, tiny_llama_dir: Path,
                                             tmp_path: Path) -> None:
    """"Bring your own task": the JSONL file and the reward file are written by the README's
    lines, and the trainer trains on them (2 steps, the tiny llama, sampling in-process)."""
    env = fresh_env(tmp_path / "home", tiny_llama_dir)
    env["GRIDRL_TRAINER_LISTEN"] = "127.0.0.1:0"
    shell = shell_factory(env)
    block = readme_block("own-task").replace("--steps 60", "--steps 2")
    assert "--master" not in block and "--steps 2" in block
    done = shell.run(block, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (shell.cwd / "upper.jsonl").read_text().splitlines()]
    assert rows[0] == {"prompt": rows[0]["prompt"], "answer": rows[0]["prompt"].upper()}
    (run_dir,) = (shell.cwd / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2, summary
    config = json.loads((run_dir / "config.json").read_text())
    assert config["reward_files"] == ["upper_reward.py"] and config["task"] == "upper.jsonl"
    assert config["system_prompt"] == "Reply with the word in capital letters and nothing else."
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    assert all(set(r["reward_funcs"]) == {"upper"} for r in records if r.get("step"))
    evals = [r for r in records if r.get("eval_score") is not None]
    assert evals and all(r["eval_n"] == 16 for r in evals), evals  # 16 rows held out
    # the eval scores with the run's own reward (upper), as the README says, and names it
    assert all(r["eval_scorer"] == "reward upper (upper_reward.py)" for r in evals), evals
    assert all(e["score"] in (0.0, 0.5, 1.0) for r in evals for e in r["eval_examples"])
    assert summary["eval_scorer"] == "reward upper (upper_reward.py)"
    assert summary["final_eval_exact"] is not None


@pytest.mark.slow
def test_the_readme_own_environment_runs_as_written(shell_factory, tiny_llama_dir: Path,
                                                    tmp_path: Path) -> None:
    """"Your own environment": the README's file is written by its lines and the trainer
    runs it as a multi-turn environment (2 steps, the tiny llama, sampling in-process): the
    episodes have a second turn, their figures and the environment's reward function reach
    log.jsonl and summary.json."""
    env = fresh_env(tmp_path / "home", tiny_llama_dir)
    env["GRIDRL_TRAINER_LISTEN"] = "127.0.0.1:0"
    shell = shell_factory(env)
    block = readme_block("own-environment")
    python = block.split("<<'PY'\n", 1)[1].split("\nPY\n", 1)[0]
    assert len(python.splitlines()) <= 22, "the README promises a ~20-line example"
    block = block.replace("--steps 60", "--steps 2")
    assert "--master" not in block and "--steps 2" in block
    done = shell.run(block, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = (shell.cwd / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["task"] == "upper_env.py", summary
    # the tiny random model never answers in capitals: every episode gets its second turn
    assert summary["turns_mean"] == 2.0 and summary["env_tokens"] > 0, summary
    assert set(summary["reward_funcs_last10"]) == {"upper:score"}, summary
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step")]
    assert all(r["turns_mean"] == 2.0 and r["episodes"] == 16 for r in steps), steps
    evals = [r for r in records if r.get("eval_score") is not None]
    assert evals and all(r["eval_n"] == 16 for r in evals), evals


@pytest.mark.slow
def test_the_readme_quick_try_is_the_demo_with_a_small_eval(tiny_llama_dir: Path,
                                                            tmp_path: Path) -> None:
    """The quick try is ``make demo`` with ``--eval-tasks 16``: the command make runs (read
    with ``make -n``), run on the tiny llama for 2 steps, evaluates 16 prompts."""
    import os

    (line,) = shell_lines(readme_block("quick-try"))
    assert line.startswith("make demo ")
    dry = subprocess.run(["bash", "-c", line.replace("make ", "make -n ", 1)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    (command,) = [ln for ln in dry.stdout.splitlines() if "gridrl.trainer.demo" in ln]
    assert command.endswith("-- --eval-tasks 16"), command
    run_dir = tmp_path / "run"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    wiring = f"--model {tiny_llama_dir} --run-dir {run_dir} --nodes"
    command = command.replace("--nodes", wiring, 1) + \
        " --steps 2 --eval-every 2 --max-tokens 4 --threads 1"
    done = subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1",
                                            "TMPDIR": str(scratch)})
    assert done.returncode in (0, 1), done.stdout[-3000:]  # 1: the tiny model did not climb
    evals = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()
             if '"eval_score"' in line]
    assert evals and {r["eval_n"] for r in evals if r.get("eval_score") is not None} == {16}


@pytest.mark.slow
def test_the_readme_openai_curl_sends_the_trained_system_prompt(live_openai_node) -> None:
    """The curl of "Over the OpenAI API" carries reverse-words' own system prompt, the one the
    run trained with, and streams an answer from a node (the tiny llama's, asked by its base
    model id in place of the pushed adapter's name)."""
    from gridrl.trainer.envs.reverse import REVERSE_SYSTEM_PROMPT

    block = readme_block("openai-curl")
    body = json.loads(re.search(r"-d '(.*)'", block, re.S).group(1))
    assert body["messages"][0] == {"role": "system", "content": REVERSE_SYSTEM_PROMPT}
    assert body["model"] == "reverse-words" and body["temperature"] == 0
    node, model_id = live_openai_node
    script = block.replace('"reverse-words"', json.dumps(model_id)).replace(
        "127.0.0.1:8000", node.openai.address)
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    events = [ln[len("data: "):] for ln in done.stdout.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2, done.stdout
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["policy_version"] for c in chunks} == {0}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.fixture
def live_openai_node(tiny_llama_dir: Path, tmp_path: Path):
    """An in-process node on the tiny llama with the OpenAI endpoint on a free port."""
    from gridrl.engine.backends.torch.backend import TorchBackend
    from gridrl.rollout.server import NodeConfig, RolloutNode

    backend = TorchBackend.from_pretrained(tiny_llama_dir)
    node = RolloutNode(backend, NodeConfig(listen="127.0.0.1:0", openai_listen="127.0.0.1:0",
                                           adapter_root=str(tmp_path / "adapters"),
                                           grace_s=2.0)).start()
    try:
        yield node, backend.identity.model_id
    finally:
        node.stop(0)


def test_the_quick_start_holds_instructions_not_dated_figures() -> None:
    """The set-up path stays short: no dates, commit hashes or CPU models in it (measured
    figures live in docs/results.md, which it points to), and it says what the eval's
    score is."""
    text = (REPO / "README.md").read_text()
    start = text.index("## Set-up on a fresh machine")
    section = text[start:text.index("### By hand, on one machine", start)]
    assert not re.search(r"\b20\d\d-\d\d(-\d\d)?\b|\b(19|20)\d\d\b", section), "a date"
    assert not re.search(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b", section), \
        "a commit hash"
    assert not re.search(r"Xeon|EPYC|Ryzen|Core i\d|Apple M\d|GHz|vCPU", section), "a CPU model"
    assert "docs/results.md" in section
    assert "exact reversal" in section and "not 77% correct" in section


def test_the_results_page_shows_each_figure_with_its_command_date_and_cpu() -> None:
    """docs/results.md: its plots exist, and each row of its summary names the command that
    measured it, the date and the CPU."""
    text = (REPO / "docs" / "results.md").read_text()
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert {"learning.png", "results_vs_trl.png", "results_envs.png"} <= set(images)
    for image in images:
        assert (REPO / "docs" / image).is_file(), image
    table = text[text.index("## In one table"):text.index("## What it learns")]
    rows = [line for line in table.splitlines() if line.startswith("| ")][2:]
    assert len(rows) >= 10, rows
    for row in rows:
        _what, _figure, command, date, cpu = (c.strip() for c in row.strip("|").split(" | "))
        assert command.startswith(("`python bench/", "`make demo`", "same command")), row
        assert re.match(r"20\d\d-\d\d-\d\d", date) and cpu in ("AVX-512", "AVX2"), row
