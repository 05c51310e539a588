"""Benchmark 4: gridrl's demo against TRL's GRPOTrainer, on the same task, model, prompt order,
LoRA init, hyper-parameters and held-out eval, over N seeds, each pair run back to back.

- gridrl: ``python -m gridrl.trainer.demo`` (master + torch rollout node + trainer as separate
  processes over gRPC) with the demo's flags (``gridrl.trainer.demo.DEMO_FLAGS``) and
  ``--seed S``.
- TRL: ``trl.GRPOTrainer`` in one process (no vLLM, float32, CPU) on the same settings. The
  model and its LoRA come from gridrl's own loader with the same seed
  (``TorchTrainerBackend.from_config``: the same code gridrl's trainer runs, so the LoRA init
  is bit-identical), the prompts are the task's ``train_item(0), train_item(1), ...`` in order
  (``shuffle_dataset=False``), the reward is the task's score, and every ``--eval-every`` steps
  a callback runs gridrl's :class:`~gridrl.trainer.evaluation.Evaluator` (batched greedy on
  the weights being trained) on the same held-out prompts.

Printed per seed and as the mean over seeds: seconds per step (generate / train split;
evals, model loading and start-up excluded), seconds of training to the first eval >= the
target (0.61), eval at steps 20 and 60 (± its standard error), and gridrl/TRL ratios. Every
TRL setting that had to be set to match gridrl is printed with its value.

    python bench/vs_trl.py [--seeds 3] [--steps 60] [--target 0.61] [--work DIR]

Needs TRL (a bench-only extra: ``pip install -e 'services/trainer[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import machine, table

# TRL settings that match gridrl's defaults and the demo's flags, with why (a key whose value
# is None is filled from the run's TrainConfig in trl_settings()).
TRL_MATCH: dict[str, tuple[Any, str]] = {
    "loss_type": ("grpo", "--loss-aggregation sequence: mean over each sequence, then over "
                          "sequences (TRL's default is dapo)"),
    "scale_rewards": ("group", "--scale-rewards: divide by the group's std (+1e-4 in both)"),
    "beta": (0.0, "--kl-beta 0: no reference model (TRL 1.16's default too)"),
    "epsilon": (None, "--clip-eps"),
    "num_iterations": (1, "one optimizer step per batch of rollouts"),
    "steps_per_generation": (1, "sample a batch, train on it, sample the next"),
    "gradient_accumulation_steps": (1, "one backward over the whole step"),
    "per_device_train_batch_size": (None, "--prompts-per-step x --group-size completions"),
    "num_generations": (None, "--group-size"),
    "max_completion_length": (None, "--max-tokens"),
    "temperature": (None, "--temperature"),
    "top_p": (None, "--top-p"),
    "top_k": (None, "--top-k (0: off)"),
    "repetition_penalty": (1.0, "gridrl's sampler has none"),
    "learning_rate": (None, "--lr"),
    "lr_scheduler_type": ("constant", "--lr-schedule constant"),
    "warmup_steps": (0, "--warmup-steps 0"),
    "weight_decay": (None, "--weight-decay"),
    "adam_beta1": (0.9, "gridrl's AdamW"),
    "adam_beta2": (0.999, "gridrl's AdamW"),
    "adam_epsilon": (1e-8, "gridrl's AdamW"),
    "optim": ("adamw_torch", "torch.optim.AdamW as gridrl"),
    "max_grad_norm": (None, "--max-grad-norm"),
    "mask_truncated_completions": (False, "gridrl trains on truncated completions too"),
    "shuffle_dataset": (False, "prompts in the task's order, as gridrl"),
    "gradient_checkpointing": (False, "TRL's default is True; gridrl does not recompute"),
    "disable_dropout": (True, "--lora-dropout 0 and the base model's dropout off"),
    "bf16": (False, "float32 as gridrl on CPU (TRL's default is bf16)"),
    "use_cpu": (True, "this machine has no GPU"),
    "use_vllm": (False, "no vLLM on CPU"),
    "max_steps": (None, "--steps"),
    "seed": (None, "--seed"),
}


def train_config(seed: int, steps: int, extra: list[str]) -> Any:
    """The demo's TrainConfig for ``seed``: ``gridrl-trainer run``'s defaults, DEMO_FLAGS,
    then ``extra`` flags, parsed and finalized as ``gridrl-trainer run`` does."""
    from gridrl.trainer.cli import build_config, main
    from gridrl.trainer.demo import DEMO_FLAGS

    # the demo's trainer finds its nodes through a master (not sampling in-process), so flags
    # that need remote nodes (--async-steps) validate as they do in the demo
    flags = [*DEMO_FLAGS, "--master", "127.0.0.1:1", "--steps", str(steps), "--seed",
             str(seed), *extra]
    ctx = main.commands["run"].make_context("run", flags)
    return build_config(ctx, dict(ctx.params))[0]


def trl_settings(cfg: Any) -> dict[str, Any]:
    """The GRPOConfig keyword arguments that match ``cfg`` (see :data:`TRL_MATCH`)."""
    from_cfg = {"epsilon": cfg.clip_eps, "per_device_train_batch_size":
                cfg.prompts_per_step * cfg.group_size, "num_generations": cfg.group_size,
                "max_completion_length": cfg.max_tokens, "temperature": cfg.temperature,
                "top_p": cfg.top_p, "top_k": cfg.top_k, "learning_rate": cfg.lr,
                "weight_decay": cfg.weight_decay, "max_grad_norm": cfg.max_grad_norm,
                "max_steps": cfg.steps, "seed": cfg.seed}
    return {k: from_cfg[k] if v is None else v for k, (v, _) in TRL_MATCH.items()}


def run_trl(seed: int, steps: int, extra: list[str], out: Path, threads: int = 0) -> None:
    """One TRL run (in this process); writes the evals and step times to ``out`` (JSON)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gridrl.trainer.backends.torch.backend import TorchTrainerBackend
    from gridrl.trainer.envs.loading import make_environment
    from gridrl.trainer.evaluation import Evaluator

    cfg = train_config(seed, steps, extra)
    cfg.rollout = ["local"]
    cfg.threads = threads
    backend = TorchTrainerBackend.from_config(cfg)  # model + LoRA exactly as gridrl's trainer
    task = make_environment(cfg.task, seed=cfg.seed, eval_size=cfg.eval_tasks,
                            min_words=cfg.min_words, max_words=cfg.max_words)
    evaluator = Evaluator(backend, task, max_tokens=cfg.max_tokens)
    items = [task.train_item(i) for i in range(cfg.steps * cfg.prompts_per_step)]
    data = Dataset.from_list([{"prompt": [dict(m) for m in it.messages],
                               "answer": it.columns["answer"]} for it in items])

    def reward(prompts: list[Any], completions: list[Any], answer: list[str],
               **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(s) for s in task.score([""] * len(texts), texts, answer=answer)]

    evals: list[dict[str, Any]] = []
    times = {"generate": [], "step": [], "eval": 0.0}

    def evaluate(step: int) -> None:
        t = time.perf_counter()
        r = evaluator.run(step)
        times["eval"] += time.perf_counter() - t
        train_s = sum(times["step"])
        evals.append({"step": step, "score": r.score, "stderr": r.stderr, "train_s": train_s,
                      "eval_s": r.seconds})
        print(f"TRL seed {seed} step {step}: eval {r.score:.3f}±{r.stderr:.3f} after "
              f"{train_s:.0f} s of training", flush=True)

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, *a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return super()._generate_and_score_completions(*a, **k)
            finally:
                times["generate"].append(time.perf_counter() - t)

        def training_step(self, *a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return super().training_step(*a, **k)
            finally:
                times["step"].append(time.perf_counter() - t)

    class Eval(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            evaluate(0)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step % cfg.eval_every == 0 or state.global_step == cfg.steps:
                evaluate(state.global_step)

    settings = trl_settings(cfg)
    tmp = tempfile.mkdtemp(prefix="bench-trl-")
    args = GRPOConfig(output_dir=tmp, logging_steps=1, save_strategy="no", report_to=[],
                      log_completions=False, dataloader_num_workers=0, **settings)
    trainer = Timed(model=backend.policy.model, reward_funcs=reward, args=args,
                    train_dataset=data, processing_class=backend.tokenizer,
                    callbacks=[Eval()])
    torch.manual_seed(seed)
    trainer.train()
    out.write_text(json.dumps({"evals": evals, "generate_s": times["generate"],
                               "step_s": times["step"], "settings": settings}))


def _gridrl_finished(run: Path, steps: int) -> bool:
    log = run / "log.jsonl"
    if not (run / "summary.json").exists() or not log.exists():
        return False
    return sum(1 for line in log.read_text().splitlines()
               if json.loads(line).get("step")) >= steps


def run_gridrl(seed: int, steps: int, extra: list[str], work: Path,
               threads: int = 0) -> dict[str, Any]:
    """One ``python -m gridrl.trainer.demo`` run; its evals and step times from log.jsonl."""
    run = work / f"gridrl-{seed}"
    if _gridrl_finished(run, steps):
        print(f"gridrl seed {seed}: reusing the finished run in {run}")
    else:
        shutil.rmtree(run, ignore_errors=True)  # an interrupted run starts over
        subprocess.run([sys.executable, "-m", "gridrl.trainer.demo", "--run-dir", str(run),
                        "--node-threads", str(threads), "--", "--steps", str(steps),
                        "--seed", str(seed), "--threads", str(threads), *extra], check=False)
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    base = next(r for r in records if r.get("event") == "baseline")
    steps_rec = [r for r in records if r.get("step")]
    evals = [{"step": 0, "score": base["eval_score"], "stderr": base.get("eval_stderr"),
              "train_s": 0.0}]
    eval_total = 0.0
    for r in steps_rec:
        eval_total += r.get("eval_s") or 0.0
        if r.get("eval_score") is not None:
            evals.append({"step": r["step"], "score": r["eval_score"],
                          "stderr": r.get("eval_stderr"), "train_s": r["elapsed_s"] - eval_total,
                          "eval_s": r.get("eval_s")})
    last = steps_rec[-1]
    return {"evals": evals, "generate_s": [r["collect_s"] for r in steps_rec],
            "train_s": [r["train_s"] for r in steps_rec],
            "step_s": (last["elapsed_s"] - eval_total) / len(steps_rec)}


def summarize(run: dict[str, Any], target: float) -> dict[str, Any]:
    """s/step (total, generate, train), time to target, eval at steps 20 and 60."""
    evals = {e["step"]: e for e in run["evals"]}
    hit = next((e for e in run["evals"] if e["score"] >= target), None)
    gen = statistics.mean(run["generate_s"])
    if "train_s" in run:  # gridrl: per-step train time from its log
        step = run["step_s"]
        train = statistics.mean(run["train_s"])
    else:
        step = statistics.mean(run["step_s"])
        train = step - gen
    return {"step_s": step, "generate_s": gen, "train_s": train,
            "hit": (hit["step"], hit["train_s"]) if hit else None,
            "eval20": evals.get(20), "eval60": evals.get(60)}


def _eval_cell(e: dict[str, Any] | None) -> str:
    if e is None:
        return "-"
    return f"{e['score']:.3f}±{e['stderr']:.3f}" if e.get("stderr") is not None else \
        f"{e['score']:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--target", type=float, default=0.61)
    ap.add_argument("--flags", default="", help="extra gridrl-trainer flags for both sides "
                    "(e.g. '--eval-tasks 64'), applied after the demo's")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads of every process (TRL's, gridrl's trainer and node; "
                    "0: torch's default). On a machine others load, 1 avoids OpenMP threads "
                    "spinning against each other")
    ap.add_argument("--only", choices=("both", "trl", "gridrl"), default="both")
    ap.add_argument("--work", default=None,
                    help="directory of the runs (default: a new temporary one); a run already "
                    "finished there (trl-SEED.json, gridrl-SEED/ with every step) is read back "
                    "instead of run again, so an interrupted comparison resumes")
    ap.add_argument("--trl-worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    extra = args.flags.split()
    if args.trl_worker is not None:
        run_trl(args.trl_worker, args.steps, extra, Path(args.out), args.threads)
        return
    print(f"machine: {machine()}")
    import trl

    cfg = train_config(args.first_seed, args.steps, extra)
    print(f"TRL {trl.__version__} GRPOTrainer settings set to match gridrl:")
    for key, value in trl_settings(cfg).items():
        print(f"  {key} = {value!r}  # {TRL_MATCH[key][1]}")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-vs-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {"TRL": [], "gridrl": []}
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    for seed in seeds:
        if args.only in ("both", "trl"):
            out = work / f"trl-{seed}.json"
            if out.exists():
                print(f"TRL seed {seed}: reusing the finished run {out}")
            else:
                subprocess.run([sys.executable, __file__, "--trl-worker", str(seed), "--steps",
                                str(args.steps), "--flags", args.flags, "--out", str(out),
                                "--threads", str(args.threads)],
                               check=True)
            results["TRL"].append(summarize(json.loads(out.read_text()), args.target))
        if args.only in ("both", "gridrl"):
            results["gridrl"].append(summarize(
                run_gridrl(seed, args.steps, extra, work, args.threads), args.target))
    rows = []
    for name, runs in results.items():
        for seed, s in zip(seeds, runs, strict=False):
            hit = f"step {s['hit'][0]} @ {s['hit'][1]:.0f} s" if s["hit"] else "not reached"
            rows.append([name, str(seed), f"{s['step_s']:.2f}", f"{s['generate_s']:.2f}",
                         f"{s['train_s']:.2f}", hit, _eval_cell(s["eval20"]),
                         _eval_cell(s["eval60"])])
    print(table(rows, ["run", "seed", "s/step", "generate s", "train s",
                       f"first eval >= {args.target}", "eval @20", "eval @60"]))
    means: dict[str, dict[str, float | None]] = {}
    for name, runs in results.items():
        if not runs:
            continue
        hits = [s["hit"][1] for s in runs if s["hit"]]
        e60 = [s["eval60"]["score"] for s in runs if s["eval60"]]
        e20 = [s["eval20"]["score"] for s in runs if s["eval20"]]
        means[name] = {
            "step_s": statistics.mean(s["step_s"] for s in runs),
            "generate_s": statistics.mean(s["generate_s"] for s in runs),
            "train_s": statistics.mean(s["train_s"] for s in runs),
            # a run that never reached the target counts with its whole training time
            "hit_s": statistics.mean(hits) if len(hits) == len(runs) else None,
            "eval20": statistics.mean(e20) if e20 else None,
            "eval60": statistics.mean(e60) if e60 else None,
        }
        m = means[name]
        print(f"{name} mean over {len(runs)} seed(s): {m['step_s']:.2f} s/step (generate "
              f"{m['generate_s']:.2f}, train {m['train_s']:.2f}); time to {args.target}: "
              + (f"{m['hit_s']:.0f} s" if m["hit_s"] is not None else
                 f"not reached by every seed ({len(hits)}/{len(runs)})")
              + (f"; eval @20 {m['eval20']:.3f}" if m["eval20"] is not None else "")
              + (f"; eval @60 {m['eval60']:.3f}" if m["eval60"] is not None else ""))
    if len(means) == 2:
        g, t = means["gridrl"], means["TRL"]
        print(f"ratios gridrl/TRL: s/step {g['step_s'] / t['step_s']:.2f}x (generate "
              f"{g['generate_s'] / t['generate_s']:.2f}x, train {g['train_s'] / t['train_s']:.2f}x)"
              + (f"; time to {args.target} {g['hit_s'] / t['hit_s']:.2f}x (goal <= 0.25x)"
                 if g["hit_s"] and t["hit_s"] else "")
              + (f"; eval @60 {g['eval60'] - t['eval60']:+.3f} (goal >= 0)"
                 if g["eval60"] is not None and t["eval60"] is not None else ""))
    print(f"runs: {work}")


if __name__ == "__main__":
    main()
