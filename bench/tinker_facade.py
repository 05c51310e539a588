"""The Tinker facade's overhead and its learning: the same RL loop through the official SDK on
``gridrl-trainer serve-api`` (``examples/tinker_rl_reverse_words.py``) and through
``gridrl-trainer run`` (the baseline), on the same machine, one after the other.

Both: reverse-words on the bundled SmolLM2-135M, 2 prompts x 8 samples a step, 24 new tokens,
temperature 1, LoRA r16/alpha 32 on all linear layers, AdamW lr 3e-4 betas (0.9, 0.999),
gradient clip 1.0, the trainer sampling itself (``--rollout local`` / ``serve-api`` without
nodes), a greedy held-out eval of 128 phrases every 10 steps. Prints seconds per step (evals
excluded) for each and their ratio (SDK / run: the facade's overhead), the eval curves, the
CPU and the load average, and writes everything as JSON.

    python bench/tinker_facade.py [--steps 60] [--record docs/tinker_facade.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import BIN, machine, table

REPO = Path(__file__).resolve().parents[1]


def load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def run_baseline(args: argparse.Namespace, work: Path) -> dict:
    """``gridrl-trainer run --rollout local`` with the example's settings."""
    run_dir = work / "run"
    cmd = [str(BIN / "gridrl-trainer"), "run", "--rollout", "local", "--steps", str(args.steps),
           "--eval-every", str(args.eval_every), "--eval-tasks", str(args.eval_tasks),
           "--model", args.model, "--run-dir", str(run_dir), "--metrics-port", "-1",
           "--listen", "127.0.0.1:0", "--seed", "0"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    steps, evals, previous = [], [], 0.0
    summary = json.loads((run_dir / "summary.json").read_text())
    evals.append([0, summary["baseline_eval"]])
    for line in (run_dir / "log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if not rec.get("step"):
            continue
        steps.append(rec["elapsed_s"] - previous - (rec.get("eval_s") or 0.0))
        previous = rec["elapsed_s"]
        if rec.get("eval_score") is not None:
            evals.append([rec["step"], rec["eval_score"]])
    return {"seconds": steps, "evals": evals}


def run_sdk(args: argparse.Namespace, work: Path) -> dict:
    """``serve-api`` (no nodes: the trainer samples) and the example loop through the SDK."""
    ready = work / "api.ready.json"
    server = subprocess.Popen(
        [str(BIN / "gridrl-trainer"), "serve-api", "--model", args.model, "--listen",
         "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--api-dir", str(work / "api"),
         "--ready-file", str(ready)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not ready.exists():
            if server.poll() is not None:
                raise RuntimeError(f"serve-api exited {server.returncode}")
            subprocess.run(["sleep", "0.2"], check=True)
        env = {**os.environ, "TINKER_BASE_URL": json.loads(ready.read_text())["tinker_base_url"],
               "TINKER_API_KEY": "tml-bench", "TINKER_TELEMETRY": "0"}
        out = work / "sdk.json"
        subprocess.run([sys.executable, str(REPO / "examples" / "tinker_rl_reverse_words.py"),
                        "--model", args.model, "--steps", str(args.steps), "--eval-every",
                        str(args.eval_every), "--eval-tasks", str(args.eval_tasks), "--out",
                        str(out)], check=True, env=env, stdout=subprocess.DEVNULL)
    finally:
        server.terminate()
        server.wait(60)
    record = json.loads(out.read_text())
    return {"seconds": [s["seconds"] for s in record["steps"]], "evals": record["evals"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-tasks", type=int, default=128)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--record", type=Path, default=None, help="write the figures here (JSON)")
    args = ap.parse_args()
    result = {"machine": machine(), "load_before": load(), "args": vars(args) | {
        "record": str(args.record)}}
    with tempfile.TemporaryDirectory(prefix="tinker-bench-") as tmp:
        work = Path(tmp)
        result["sdk"] = run_sdk(args, work)
        result["load_between"] = load()
        result["run"] = run_baseline(args, work)
    result["load_after"] = load()
    rows = []
    for name in ("run", "sdk"):
        s = result[name]["seconds"]
        rows.append([name, f"{statistics.median(s):.2f}", f"{statistics.mean(s):.2f}",
                     " ".join(f"{st}:{e:.2f}" for st, e in result[name]["evals"])])
    ratio = statistics.median(result["sdk"]["seconds"]) / statistics.median(
        result["run"]["seconds"])
    print(f"{result['machine']}; load average before / between / after: "
          f"{result['load_before']} / {result['load_between']} / {result['load_after']}")
    print(table(rows, ["loop", "median s/step", "mean s/step", "eval by step"]))
    print(f"SDK through serve-api / gridrl-trainer run, median s/step: {ratio:.2f}x")
    result["ratio_median"] = ratio
    if args.record:
        args.record.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
