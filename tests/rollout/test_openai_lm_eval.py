"""lm-evaluation-harness (``lm-eval``, its ``local-completions`` model) evaluates a rollout
node through its OpenAI endpoint as it evaluates a vLLM server: a loglikelihood task (multiple
choice: ``echo`` with ``logprobs`` 1 and ``max_tokens`` 1 per choice) and a generate-until task,
each defined in a local YAML over a local JSONL file. Its loglikelihoods equal the trainer's
own scoring of the same strings (the torch trainer backend's teacher-forced logprobs at
temperature 1) within 1e-4; its generations are the node's greedy samples."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

# The node's forward (cached prefill, the lean llama) against the trainer's (peft over
# transformers): float32 sums in another order, summed over a continuation's few tokens.
LOGLIKELIHOOD_TOL = 1e-4

CHOICES = [
    {"question": "the red cat", "choices": ["jump", "sky blue", "sea"], "label": 0},
    {"question": "a dog run", "choices": ["the sky", "order"], "label": 1},
    {"question": "reverse words :", "choices": ["blue red", "cat", "dog sea sky"], "label": 2},
]
QUESTIONS = [{"question": "the cat", "answer": "run"}, {"question": "blue sky :", "answer": "a"}]


def _write_tasks(root: Path) -> Path:
    """Two tasks in ``root`` (lm-eval's ``--include_path``), their data beside them."""
    root.mkdir()
    for name, rows in (("choice", CHOICES), ("questions", QUESTIONS)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "gridrl_choice.yaml").write_text(f"""\
task: gridrl_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "choice.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
""")
    (root / "gridrl_generate.yaml").write_text(f"""\
task: gridrl_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "questions.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 4
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""")
    return root


@pytest.mark.slow
def test_lm_eval_loglikelihoods_equal_the_trainers_scoring(live_node, tiny_llama_dir: Path,
                                                           tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # local JSONL: no hub
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    import lm_eval
    from lm_eval.tasks import TaskManager

    node = live_node(openai_listen="127.0.0.1:0")
    model = node.node.backend.identity.model_id
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": model, "base_url": f"{node.node.openai.base_url}/completions",
                    "tokenizer": str(tiny_llama_dir), "tokenizer_backend": "huggingface",
                    "num_concurrent": 1, "max_retries": 1, "max_length": 512},
        tasks=["gridrl_choice", "gridrl_generate"],
        task_manager=TaskManager(include_path=str(_write_tasks(tmp_path / "tasks"))),
        log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
        fewshot_random_seed=0)
    samples = results["samples"]

    # loglikelihoods: one request per (question, choice), scored by the trainer's backend
    from gridrl.trainer.backends.base import TrainSequence, create_backend
    from gridrl.trainer.config import TrainConfig

    trainer = create_backend(TrainConfig(
        model=str(tiny_llama_dir), backend="torch", device="cpu", dtype="float32",
        temperature=1.0, rollout=["local"], run_dir=str(tmp_path / "unused")).finalize())
    tokenizer = node.node.backend.tokenizer
    chosen = []
    for sample in sorted(samples["gridrl_choice"], key=lambda s: s["doc_id"]):
        doc = CHOICES[sample["doc_id"]]
        assert [a[1].strip() for a in sample["arguments"]] == doc["choices"]
        got = [float(r[0][0]) for r in sample["resps"]]
        want = []
        for context, continuation in (a[:2] for a in sample["arguments"]):
            whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
            ctx = tokenizer(context, add_special_tokens=False).input_ids
            seq = TrainSequence(tuple(ctx), tuple(whole[len(ctx):]), (), 0.0, 0)
            want.append(math.fsum(trainer.logprobs([seq])[0]))
        assert got == pytest.approx(want, abs=LOGLIKELIHOOD_TOL), (sample["doc_id"], got, want)
        chosen.append(int(max(range(len(got)), key=got.__getitem__) == doc["label"]))
    acc = results["results"]["gridrl_choice"]["acc,none"]
    assert acc == pytest.approx(sum(chosen) / len(chosen))

    # generations: the node's greedy samples, cut at the task's stop string
    for sample in samples["gridrl_generate"]:
        prompt = tokenizer(QUESTIONS[sample["doc_id"]]["question"],
                           add_special_tokens=False).input_ids
        greedy = node.generate(prompt, max_tokens=4, temperature=0.0).samples[0].text
        assert sample["resps"][0][0] == greedy.split(".")[0]
