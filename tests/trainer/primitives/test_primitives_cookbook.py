"""A tinker-cookbook (0.6.1) RL recipe, unchanged, against ``gridrl-trainer serve-api``:
``tinker_cookbook.recipes.math_rl.train`` on its procedural ``arithmetic`` environment, run as
its command line with only configuration changed: the model (a tiny llama with the bundled
SmolLM2's ChatML tokenizer, a local directory), the base URL, the renderer (the model is not in
the cookbook's lineup; ``qwen3_instruct`` renders ChatML), the loss (``importance_sampling``:
the recipe's default ``stable_reinforce`` needs server-side stability records gridrl does not
keep) and the batch, step count and logging for a CI budget. The cookbook is installed by the
Makefile (see ``COOKBOOK`` there for why without pip's resolver)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker_cookbook", reason="tinker-cookbook (Makefile: COOKBOOK)")


@pytest.mark.slow
def test_the_cookbook_math_rl_recipe_trains_on_serve_api(service_factory, smollm2_dir: Path,
                                                         tmp_path: Path) -> None:
    from gridrl.models.testing import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny-chatml", tokenizer_from=smollm2_dir)
    api = service_factory(["gridrl-trainer", "serve-api", "--model", str(model), "--listen",
                           "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--api-dir",
                           str(tmp_path / "api"), "--threads", "1"], "serve-api")
    log_path = tmp_path / "recipe"
    env = {**os.environ, "TINKER_API_KEY": "tml-ci", "TINKER_TELEMETRY": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", f"model_name={model}",
         f"base_url={api.info['tinker_base_url']}", "renderer_name=qwen3_instruct",
         "env=arithmetic", "loss_fn=importance_sampling", "groups_per_batch=2", "group_size=2",
         "lora_rank=4", "max_tokens=4", "max_steps=2", "eval_every=0", "save_every=0",
         f"log_path={log_path}", "behavior_if_log_dir_exists=delete"],
        env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:] + api.log()[-2000:]
    metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "optim/lr" in m]
    assert [m["optimizer_step:unique"] for m in steps] == [1.0, 2.0], metrics
    # the final checkpoint the recipe saves is gridrl's: a state and sampler weights on disk
    saved = [json.loads(line) for line in
             (log_path / "checkpoints.jsonl").read_text().splitlines()]
    assert saved, "the recipe saved no checkpoint"
    for key, kind in (("state_path", "weights"), ("sampler_path", "sampler_weights")):
        model_id, got_kind, name = saved[-1][key].removeprefix("tinker://").split("/")
        folder = tmp_path / "api" / model_id.replace(":", "-") / kind / name
        assert got_kind == kind and folder.is_dir(), (saved[-1], folder)
