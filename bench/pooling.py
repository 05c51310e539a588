"""Pooling: what does one more rollout node buy?

Runs ``gridrl-trainer run`` (reverse-words, the bundled SmolLM2-135M, LoRA rank 16, its
default 2 prompts of 8 completions a step; ``--prompts-per-step`` changes it) against 1, 2 and
4 rollout nodes, with ``--async-steps 0`` and ``1``,
and reports the time per step and the time to a target held-out eval, next to what a model
of the step predicts.

What is simulated (this box has 2 cores, shared with other work; a pooled fleet has a machine
per node): the trainer runs pinned to core 0 (``taskset -c 0``, one torch thread); every node
is a real torch rollout node on the same model pinned to core 1 (one thread), made slower by a
calibrated, fixed amount so that up to 4 of them on one core each keep their own speed:

- each node decodes one group at a time (``capacity`` = the group size, 8 sequences), and
- each of its decode steps (the prefill counting as the first) ends no earlier than
  ``k x S`` seconds after the batch started (it sleeps the rest), with
  ``S = SLOWDOWN x`` the step time of the same node measured alone on core 1 (calibrated at
  the start of every run of this bench). With ``SLOWDOWN`` = 5 > 4 nodes, four nodes' real
  compute fits in their padded steps, so each behaves like a machine 5x slower than one core
  of this box at decoding (a laptop-class node), independent of how many share the core.

Everything else is real: the GRPO update, the adapter pushes (over loopback), the scheduling of
groups onto nodes, staleness and the evals.

The model (times in seconds, from the runs' own ``log.jsonl``): with ``B`` groups a step,
``g`` a group's rollout time on one node, ``U`` the update time, ``P`` the push time and ``o``
the rest of a step (scoring, bookkeeping; fitted once, on the 1-node ``--async-steps 0`` run):

    async 0:  T(n) = ceil(B / n) * g + U + P + o
    async 1:  T(n) = max(ceil(B / n) * g, U + P) + o      (sampling overlaps the update)

``g`` is measured on the 1-node async-0 run (its rollout time / B); ``U`` and ``P`` on each run.

Time to target: the training seconds (``elapsed_s`` less the evals' ``eval_s``) at the first
held-out eval (every ``--eval-every`` steps, ``--eval-tasks 16``) >= ``--target``; 0 s when the
baseline eval already reaches it. Its model is the steps the run took to reach it x the
model's ``T(n)``: the node count changes the seconds a step, not the samples a step, so at
async 0 the steps to target do not depend on it (async 1 trains on one-step-stale samples and
may need other steps). A second table prints it per (nodes, async) pair with the model's error,
and a last line the largest model error over the runs (time per step and time to target).

    python bench/pooling.py [--runs 1:0,2:0,4:0,1:1,2:1,4:1] [--steps 20] [--target 0.4]
                            [--eval-every 5] [--prompts-per-step 2] [--plot docs/pooling.png]
    python bench/pooling.py --rows OUTPUT --target 0.5     # report printed rows again

The figure (a quiet machine, about an hour; 4 groups a step so that a fourth node has a
group of its own):

    python bench/pooling.py --runs 1:0,2:0,4:0,1:1,2:1,4:1 --prompts-per-step 4 \
        --steps 30 --eval-every 5 --target 0.6 --plot docs/pooling.png | tee pooling.txt
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
BIN = Path(sys.executable).parent

SLOWDOWN = 5.0
GROUP = 8
PROMPTS = 2  # gridrl-trainer run's default (--prompts-per-step)
MAX_TOKENS = 24  # reverse-words' own


def padded_backend(inner, step_s: float):
    """``inner`` whose decode steps are padded to ``step_s`` seconds each (module docstring)."""
    from gridrl.engine.contract import Backend

    class Padded(Backend):
        def __init__(self) -> None:
            self.inner = inner
            for attr in ("name", "adapter_format", "device", "dtype", "identity", "tokenizer",
                         "eos_token_ids", "interrupt_is_synchronous", "kv_bytes_per_token",
                         "sequence_bytes", "temperature_range"):
                setattr(self, attr, getattr(inner, attr))
            self.vocab_size = inner.vocab_size

        def generate(self, batch, adapter, observer=None):
            return inner.generate(batch, adapter, _PadObserver(observer, step_s))

        def load_adapter(self, directory, key):
            return inner.load_adapter(directory, key)

        def load_adapter_files(self, files, key):
            return inner.load_adapter_files(files, key)

        def unload_adapter(self, adapter) -> None:
            inner.unload_adapter(adapter)

        def score(self, prompt_ids, completion_ids, sampling, adapter):
            return inner.score(prompt_ids, completion_ids, sampling, adapter)

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

    return Padded()


class _PadObserver:
    """Sleeps so that the k-th decode step of a batch ends no earlier than k x step_s."""

    def __init__(self, inner, step_s: float) -> None:
        self.inner, self.step_s = inner, step_s
        self.start = time.monotonic()
        self.steps = 0

    def on_tokens(self, *args, **kw) -> None:
        if self.inner is not None:
            self.inner.on_tokens(*args, **kw)
        self.steps += 1
        left = self.start + self.steps * self.step_s - time.monotonic()
        if left > 0:
            time.sleep(left)

    def interrupted(self) -> bool:
        return self.inner is not None and self.inner.interrupted()


def serve_node(args: argparse.Namespace) -> None:
    """One padded torch node on loopback until SIGTERM."""
    import logging

    from gridrl.common.cli import write_ready_file
    from gridrl.models import resolve_model
    from gridrl.rollout.config import NodeConfig
    from gridrl.rollout.launch import build_backend
    from gridrl.rollout.server import RolloutNode, run_on_engine_thread

    logging.basicConfig(level=logging.WARNING)
    config = NodeConfig(listen="127.0.0.1:0", model=args.model, backend="torch", threads=1,
                        capacity=GROUP, metrics_port=-1, adapter_root=Path(args.adapter_root))
    model_dir = resolve_model(config.model, progress=False)
    node = run_on_engine_thread(lambda: RolloutNode(
        padded_backend(build_backend(config, model_dir), args.step_s), config))
    node.start()
    write_ready_file(args.ready_file, node.address, node.port, -1)
    node.wait()


def _pinned_node(model: str, step_s: float, work: Path, i: int):
    """A node process pinned to core 1 (``taskset``), started like bench/_common.Proc."""
    ready = work / f"node{i}.ready.json"
    ready.unlink(missing_ok=True)  # a node of an earlier run left its own
    log = work / f"node{i}.log"
    proc = subprocess.Popen(["taskset", "-c", "1", sys.executable, str(Path(__file__)), "node",
                             "--model", model, "--step-s", str(step_s), "--adapter-root",
                             str(work / f"node{i}"), "--ready-file", str(ready)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 300
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"node {i} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc, json.loads(ready.read_text())["address"]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def calibrate(model: str, work: Path) -> float:
    """Seconds per decode step of one unpadded node alone on core 1: a group of GROUP
    completions of MAX_TOKENS tokens (the median of 5 after a warm-up)."""
    from gridrl.common.rpc.channel import dial
    from gridrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

    proc, address = _pinned_node(model, 0.0, work, 99)
    try:
        stub = rollout_pb2_grpc.RolloutServiceStub(dial(address))
        request = rollout_pb2.GenerateRequest(
            prompt_text="Reverse the order of the words: apple river stone cloud",
            apply_chat_template=True, sampling=common_pb2.SamplingParams(
                n=GROUP, max_tokens=MAX_TOKENS, temperature=1.0, seed=1))
        times = []
        for _ in range(4):
            t = time.perf_counter()
            out = stub.Generate(request, timeout=300)
            steps = max(len(s.token_ids) for s in out.samples)
            times.append((time.perf_counter() - t) / steps)
        return statistics.median(times[1:])  # the first warms up
    finally:
        _stop(proc)


def run_one(model: str, nodes: int, async_steps: int, steps: int, step_s: float, work: Path,
            seed: int, eval_every: int) -> list[dict]:
    """One training run; its log.jsonl records."""
    procs = []
    try:
        addresses = []
        for i in range(nodes):
            proc, address = _pinned_node(model, step_s, work, i)
            procs.append(proc)
            addresses.append(address)
        run_dir = work / f"run-n{nodes}-a{async_steps}"
        argv = ["taskset", "-c", "0", str(BIN / "gridrl-trainer"), "run", "--model", model,
                "--task", "reverse-words", "--steps", str(steps), "--async-steps",
                str(async_steps), "--prompts-per-step", str(PROMPTS), "--group-size", str(GROUP),
                "--eval-every", str(eval_every), "--eval-tasks", "16", "--threads", "1",
                "--seed", str(seed),
                "--min-nodes", str(nodes), "--run-dir", str(run_dir), "--listen", "127.0.0.1:0",
                "--metrics-port", "-1", "--no-relay"]
        for a in addresses:
            argv += ["--rollout", a]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=3600,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        if out.returncode != 0:
            raise RuntimeError(f"trainer exited {out.returncode}:\n{out.stderr[-3000:]}")
        return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()
                if line.strip()]
    finally:
        for p in procs:
            _stop(p)


def time_to_target(baseline: float | None, evals: list, target: float
                   ) -> tuple[int, float] | None:
    """``(step, training seconds)`` of the first held-out eval >= ``target`` (``(0, 0.0)``
    when the baseline reaches it), from ``evals`` = ``[step, score, training seconds]``
    entries in step order; None when none reaches it."""
    if baseline is not None and baseline >= target:
        return 0, 0.0
    for step, score, seconds in evals:
        if score >= target:
            return step, seconds
    return None


def summarize(records: list[dict], target: float) -> dict[str, Any]:
    """Time per step (median over steps 2.., whose rollouts ran at full pipeline), its
    parts, each eval with the training seconds (evals excluded) at it, and the time to
    target (:func:`time_to_target`)."""
    steps = [r for r in records if "step" in r and "rollout_s" in r]
    if not steps:
        raise RuntimeError("the run's log.jsonl has no step record")
    body = steps[1:] or steps
    per_step = statistics.median(b["elapsed_s"] - a["elapsed_s"] - (b.get("eval_s") or 0.0)
                                 for a, b in itertools.pairwise(steps)) \
        if len(steps) > 1 else steps[0]["elapsed_s"]
    baseline = next((r.get("eval_score") for r in records if r.get("event") == "baseline"),
                    None)
    evals, evals_s = [], 0.0
    for r in steps:
        evals_s += r.get("eval_s") or 0.0
        if r.get("eval_score") is not None:
            evals.append([r["step"], r["eval_score"], r["elapsed_s"] - evals_s])
    reached = time_to_target(baseline, evals, target)
    return {"step_s": per_step,
            "rollout_s": statistics.median(r["rollout_s"] for r in body),
            "train_s": statistics.median(r["train_s"] for r in body),
            "sync_s": statistics.median(r["sync_s"] for r in body),
            "baseline_eval": baseline, "evals": evals,
            "target_step": reached[0] if reached else None,
            "target_s": reached[1] if reached else None}


def predict(n: int, async_steps: int, g: float, u: float, p: float, o: float) -> float:
    """The model's time per step (module docstring)."""
    roll = math.ceil(PROMPTS / n) * g  # B groups, one at a time per node
    return (max(roll, u + p) if async_steps else roll + u + p) + o


def target_row(r: dict, step_pred: float) -> tuple[str, str, float | None]:
    """The "time to target" cells of a run: measured (seconds and step), the model's (the
    steps the run took to reach it x the model's time per step), and the model's relative
    error (None when the target was not reached, or reached by the baseline)."""
    if r["target_s"] is None:
        return "not reached", "-", None
    measured = f"{r['target_s']:.0f} s (step {r['target_step']})"
    if not r["target_step"]:
        return measured, "0 s", None
    pred = r["target_step"] * step_pred
    return measured, f"{pred:.0f} s", r["target_s"] / pred - 1


def main() -> None:
    global PROMPTS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    node = sub.add_parser("node", help="(internal) a padded node")
    node.add_argument("--model", required=True)
    node.add_argument("--step-s", type=float, required=True)
    node.add_argument("--adapter-root", required=True)
    node.add_argument("--ready-file", required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--runs", default="1:0,2:0,4:0,1:1,2:1,4:1",
                        help="NODES:ASYNC_STEPS pairs, run in this order")
    parser.add_argument("--rows", help="no runs: report the JSON rows this bench printed "
                                       "(one a line) in FILE; each eval carries its training "
                                       "seconds, so --target may differ from the runs'")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--target", type=float, default=0.4, help="held-out eval to reach")
    parser.add_argument("--slowdown", type=float, default=SLOWDOWN,
                        help="padded step = this x the step measured alone (> node count)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts-per-step", type=int, default=PROMPTS, help="B")
    parser.add_argument("--step-s", type=float, help="skip the calibration: padded step (s)")
    parser.add_argument("--plot", help="write a PNG of time per step vs nodes here")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.command == "node":
        serve_node(args)
        return
    PROMPTS = args.prompts_per_step
    from _common import cpu_flags, load_average, machine, table

    results: dict[tuple[int, int], dict] = {}
    if args.rows:
        for line in Path(args.rows).read_text().splitlines():
            if line.startswith('{"nodes"'):
                row = json.loads(line)
                if all(len(e) == 3 for e in row["evals"]):  # any --target, from the evals
                    reached = time_to_target(row.get("baseline_eval"), row["evals"],
                                             args.target)
                    row["target_step"], row["target_s"] = reached or (None, None)
                results[(row.pop("nodes"), row.pop("async_steps"))] = row
        step_s = args.step_s or 0.0
        real = step_s / args.slowdown
    with tempfile.TemporaryDirectory(prefix="pooling-") as tmp:
        work = Path(tmp)
        if args.rows:
            pass
        elif args.step_s:
            real, step_s = args.step_s / args.slowdown, args.step_s
        else:
            real = calibrate(args.model, work)
            step_s = args.slowdown * real
        print(f"{'(rows read back) ' if args.rows else ''}calibration: a node alone on core 1 decodes a group of {GROUP} at "
              f"{real * 1e3:.1f} ms a step; simulated nodes: {step_s * 1e3:.1f} ms a step "
              f"({args.slowdown:g}x)", flush=True)
        for pair in [] if args.rows else args.runs.split(","):
            n, a = (int(x) for x in pair.split(":"))
            records = run_one(args.model, n, a, args.steps, step_s, work, args.seed,
                              args.eval_every)
            results[(n, a)] = summarize(records, args.target)
            print(json.dumps({"nodes": n, "async_steps": a, **results[(n, a)]}), flush=True)
    base = results.get((1, 0)) or next(iter(results.values()))
    g = base["rollout_s"] / PROMPTS
    o = base["step_s"] - (base["rollout_s"] + base["train_s"] + base["sync_s"])
    rows, target_rows, errors, target_errors = [], [], [], []
    for (n, a), r in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        pred = predict(n, a, g, r["train_s"], r["sync_s"], o)
        one = results.get((1, a), base)
        errors.append(r["step_s"] / pred - 1)
        rows.append([str(a), str(n), f"{r['step_s']:.2f}", f"{pred:.2f}",
                     f"{errors[-1]:+.0%}", f"{one['step_s'] / r['step_s']:.2f}x",
                     f"{r['rollout_s']:.2f}", f"{r['train_s']:.2f}", f"{r['sync_s']:.2f}",
                     " ".join(f"{e[0]}:{e[1]:.2f}" for e in r["evals"])])
        measured, modelled, error = target_row(r, pred)
        if error is not None:
            target_errors.append(error)
        one_target = one.get("target_s")
        speedup = (f"{one_target / r['target_s']:.2f}x" if one_target and r["target_s"]
                   else "-")
        target_rows.append([str(a), str(n), measured if r["target_s"] is not None
                            else f"not in {args.steps} steps", modelled,
                            f"{error:+.0%}" if error is not None else "-", speedup])
    print()
    print(f"machine: {machine()}; load average {load_average()}")
    print(f"CPU flags: {cpu_flags()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"model inputs: g = {g:.2f} s a group on one node, o = {o:.2f} s (fitted on 1 node, "
          f"async 0); U, P per run")
    print(table(rows, ["async", "nodes", "s/step", "model", "model error", "speed-up vs 1",
                       "rollout s", "update s", "push s", "evals (step:score)"]))
    print()
    print(f"time to target: training seconds (evals excluded) to the first held-out eval >= "
          f"{args.target} (every {args.eval_every} steps); model = the run's steps to it x "
          f"the model's s/step")
    print(table(target_rows, ["async", "nodes", "time to target", "model", "model error",
                              "speed-up vs 1"]))
    print()
    print("prediction model check: s/step within "
          f"{max(abs(e) for e in errors):.0%} of the model over {len(errors)} runs"
          + (f"; time to target within {max(abs(e) for e in target_errors):.0%} over "
             f"{len(target_errors)} runs that reached it" if target_errors
             else "; no run reached the target after step 0 (no time-to-target check)"))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"step_s_simulated": step_s, "step_s_alone": real, "g": g, "o": o,
             "runs": [{"nodes": n, "async_steps": a, **r} for (n, a), r in results.items()]},
            indent=1))
    if args.plot:
        _plot(results, g, o, Path(args.plot))


def _plot(results: dict, g: float, o: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
    for a, color in ((0, "tab:blue"), (1, "tab:orange")):
        runs = sorted((n, r) for (n, aa), r in results.items() if aa == a)
        if not runs:
            continue
        ns = [n for n, _ in runs]
        ax.plot(ns, [r["step_s"] for _, r in runs], "o", color=color,
                label=f"--async-steps {a}: measured")
        ax.plot(ns, [predict(n, a, g, r["train_s"], r["sync_s"], o) for n, r in runs], "-",
                color=color, alpha=0.6, label=f"--async-steps {a}: model")
    ax.set_xlabel("rollout nodes")
    ax.set_ylabel("seconds per step")
    ax.set_xticks(sorted({n for n, _ in results}))
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    ax.set_title("What one more node buys (simulated node speed)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


if __name__ == "__main__":
    main()
