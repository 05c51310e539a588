"""Conformance of every trainer backend (:class:`gridrl.trainer.backends.base.TrainerBackend`) on the
tiny llama in float32: what the training loop relies on, checked against framework-independent
references (transformers' own forward of the base model, hand-computed GRPO values, peft's
loader, the adapter converter) rather than against the torch backend's internals.

A new backend joins by adding its name to ``BACKENDS_UNDER_TEST`` (with its marker, e.g.
``pytest.param("mlx", marks=pytest.mark.mlx)``).
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
from float_bounds import ROUNDING_REL, assert_close_to_largest
from lora_gradients import capture_gradients, random_adapter

from gridrl.common.errors import Kind
from gridrl.trainer.backends.base import (
    RESERVED_CHECKPOINT_FILES,
    TrainerBackend,
    TrainSequence,
    create_backend,
)
from gridrl.trainer.config import BACKENDS, TrainConfig

BACKENDS_UNDER_TEST = [pytest.param("torch", id="torch"),
                       pytest.param("mlx", id="mlx", marks=pytest.mark.mlx)]
VOCAB = 512  # the tiny llama's
RANK, ALPHA = 4, 8.0


def test_every_registered_backend_is_under_test():
    assert {p.values[0] for p in BACKENDS_UNDER_TEST} == set(BACKENDS)


@pytest.fixture(params=BACKENDS_UNDER_TEST)
def make_backend(request, tiny_llama_dir):
    """``make_backend(**settings)``: a fresh backend of the parametrized kind (closed after)."""
    made: list[TrainerBackend] = []

    def make(**settings) -> TrainerBackend:
        base = dict(model=str(tiny_llama_dir), backend=request.param, lora_rank=RANK,
                    lora_alpha=ALPHA, lr=1e-2, steps=4, max_tokens=8, temperature=1.0,
                    device="cpu", dtype="float32", rollout=["local"], run_dir="unused")
        backend = create_backend(TrainConfig(**{**base, **settings}).finalize())
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def _sequences(seed: int = 1, advantages=(1.0, -1.0, 0.5, -0.5)) -> list[TrainSequence]:
    """Four sequences in two groups (two prompts), ragged prompts and completions."""
    rng = np.random.default_rng(seed)
    prompts = [tuple(int(t) for t in rng.integers(7, VOCAB, p)) for p in (5, 9)]
    seqs = []
    for i, c in enumerate((3, 6, 1, 4)):
        completion = tuple(int(t) for t in rng.integers(7, VOCAB, c))
        seqs.append(TrainSequence(prompts[i // 2], completion, tuple([-3.0] * c),
                                  advantage=advantages[i], group=i // 2))
    return seqs


def _base_logprobs(model_dir, seqs, temperature: float) -> list[list[float]]:
    """The base model's logprobs of each completion under ``softmax(logits / T)``, from
    transformers' own forward (float32, one unpadded sequence at a time)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([list(s.prompt_ids) + list(s.completion_ids)])
            logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1].float()
            lp = torch.log_softmax(logits / temperature, -1)
            out.append(lp.gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0].tolist())
    return out


def _flat(rows: list[list[float]]) -> np.ndarray:
    return np.array([x for row in rows for x in row])


def _with_behaviour(seqs, logprobs) -> list[TrainSequence]:
    return [TrainSequence(s.prompt_ids, s.completion_ids, tuple(lp), s.advantage, s.group)
            for s, lp in zip(seqs, logprobs, strict=True)]


def test_backend_describes_its_model(make_backend, tiny_llama_dir):
    backend = make_backend()
    assert isinstance(backend, TrainerBackend) and backend.name in BACKENDS
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    assert backend.identity.num_layers == config["num_hidden_layers"]
    assert backend.identity.vocab_size == config["vocab_size"] == VOCAB
    assert backend.tokenizer.apply_chat_template([{"role": "user", "content": "w1 w2"}],
                                                 add_generation_prompt=True, tokenize=True)
    assert not backend.low_precision  # float32
    assert (backend.rank, backend.world_size) == (0, 1)
    box = {"step": 3}
    assert backend.broadcast(box) is box


def test_same_seed_same_lora_init_and_a_fresh_adapter_is_the_base_model(make_backend,
                                                                        tiny_llama_dir):
    a, b = make_backend(seed=5), make_backend(seed=5)
    assert a.adapter_files() == b.adapter_files()
    assert make_backend(seed=6).adapter_files() != a.adapter_files()  # A is random
    seqs = _sequences()
    for temperature in (1.0, 0.7):
        backend = make_backend(temperature=temperature)
        got = _flat(backend.logprobs(seqs))
        want = _flat(_base_logprobs(tiny_llama_dir, seqs, temperature))
        assert got.shape == want.shape == (14,)
        np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=5),
                                      dict(temperature=0.8, top_p=0.9)],
                         ids=["T1", "T0.7-top-k", "T0.8-top-p"])
def test_generate_is_seeded_and_logprobs_reproduce_the_behaviour(make_backend, sampling):
    """The behaviour-logprob invariant: the trainer's logprobs of its own samples, under the
    sampler's transform, equal the logprobs they were sampled with."""
    from gridrl.engine.contract import SamplingConfig

    backend = make_backend(**sampling)
    prompts = [list(s.prompt_ids) for s in _sequences()[::2]] * 3
    config = SamplingConfig(max_tokens=8, **sampling)
    seeds = list(range(len(prompts)))
    first = backend.generate(prompts, config, seeds)
    again = backend.generate(prompts, config, seeds)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert [r.logprobs for r in first] == [r.logprobs for r in again]
    assert len({tuple(r.token_ids) for r in first}) > 2  # different seeds, different samples
    for r in first:
        assert 1 <= len(r.token_ids) <= 8 and len(r.logprobs) == len(r.token_ids)
        assert r.finish_reason == ("length" if len(r.token_ids) == 8 else "stop")
    seqs = [TrainSequence(tuple(p), tuple(r.token_ids), (), 0.0, 0)
            for p, r in zip(prompts, first, strict=True)]
    trainer = _flat(backend.logprobs(seqs))
    behaviour = _flat([r.logprobs for r in first])
    np.testing.assert_allclose(trainer, behaviour, atol=1e-4)
    assert np.all(behaviour > -100)


def test_greedy_generation_follows_the_argmax_of_the_model(make_backend, tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from gridrl.engine.contract import SamplingConfig

    backend = make_backend()
    prompts = [list(s.prompt_ids) for s in _sequences()[::2]]
    results = backend.generate(prompts, SamplingConfig(max_tokens=6, temperature=0.0), [0, 0])
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for prompt, r in zip(prompts, results, strict=True):
        ids = list(prompt)
        with torch.no_grad():
            for token, logprob in zip(r.token_ids, r.logprobs, strict=True):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                assert token == int(logits.argmax())
                # greedy logprobs are log_softmax at temperature 1 (engine contract, step 2)
                assert logprob == pytest.approx(float(torch.log_softmax(logits, -1)[token]),
                                                abs=1e-4)
                ids.append(token)


def test_the_eval_with_a_shared_prefix_is_the_plain_eval(make_backend):
    """The held-out eval prefills its prompts' common prefix (the task's system prompt) once
    when the backend can: the same greedy completions and scores as every prompt prefilled
    whole, on trained (non-zero) LoRA weights."""
    from gridrl.engine.contract import SamplingConfig
    from gridrl.trainer.envs.reverse import ReverseWords
    from gridrl.trainer.evaluation import Evaluator

    backend = make_backend()
    backend.update(_sequences())  # LoRA B no longer zero: the adapter changes the outputs
    task = ReverseWords(seed=0, min_words=3, max_words=4, eval_size=12)
    shared = Evaluator(backend, task, max_tokens=8)
    plain = Evaluator(backend, task, max_tokens=8, shared_prefix=False)
    assert shared.shared_prefix and len(shared.prompt_ids) == 12
    greedy = SamplingConfig(max_tokens=8, temperature=0.0)
    seeds = [0] * 12
    got = backend.generate(shared.prompt_ids, greedy, seeds, shared_prefix=True)
    want = backend.generate(plain.prompt_ids, greedy, seeds)
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    first, second = shared.run(policy_version=1), plain.run(policy_version=1)
    assert (first.score, first.exact, first.stderr, first.examples) == (
        second.score, second.exact, second.stderr, second.examples)


def test_a_slow_eval_says_so_and_a_fast_one_stays_silent(make_backend, caplog):
    """An eval still decoding after ``status_delay_s`` logs a status line naming the policy
    version and the prompts (off a terminal: plain log records, then "done after"); with the
    default delay a quick eval logs nothing."""
    import logging
    import threading

    from gridrl.trainer.envs.reverse import ReverseWords
    from gridrl.trainer.evaluation import Evaluator

    caplog.set_level(logging.INFO, logger="gridrl.progress")
    backend = make_backend()
    task = ReverseWords(seed=0, min_words=3, max_words=4, eval_size=4)

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "gridrl.progress"]

    Evaluator(backend, task, max_tokens=4).run(policy_version=0)
    assert said() == []

    generate, shown = backend.generate, threading.Event()

    class Spoken(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            shown.set()

    def slow_generate(*args, **kwargs):  # returns once the status line has spoken
        shown.wait(60)  # hang guard
        return generate(*args, **kwargs)

    handler = Spoken()
    logging.getLogger("gridrl.progress").addHandler(handler)
    backend.generate = slow_generate
    try:
        result = Evaluator(backend, task, max_tokens=4, status_delay_s=0).run(policy_version=3)
    finally:
        backend.generate = generate
        logging.getLogger("gridrl.progress").removeHandler(handler)
    assert shown.is_set() and result.n == 4
    first, last = said()[0], said()[-1]
    assert first.startswith("held-out eval of policy version 3: 4 prompts, greedy")
    assert last.startswith("held-out eval of policy version 3: 4 prompts") and \
        ": done after " in last


def test_update_at_ratio_one_gives_the_grpo_values(make_backend):
    """On-policy behaviour (ratio 1 everywhere): mismatch KL 0, nothing clipped, and the
    sequence-aggregated loss is -mean(A); with beta > 0 the reference KL is 0 at the start
    (a fresh adapter is the base model)."""
    backend = make_backend(kl_beta=0.05)
    seqs = _sequences(advantages=(1.0, -0.5, 0.25, 0.75))
    seqs = _with_behaviour(seqs, backend.logprobs(seqs))
    stats = backend.update(seqs)
    assert stats.mismatch_kl < 1e-6 and max(stats.per_sequence_mismatch_kl) < 1e-6
    assert len(stats.per_sequence_mismatch_kl) == 4
    assert stats.clip_fraction == 0.0
    assert stats.loss == pytest.approx(-(1.0 - 0.5 + 0.25 + 0.75) / 4, abs=1e-5)
    assert stats.ref_kl == pytest.approx(0.0, abs=1e-6)
    assert stats.tokens == 14 and stats.lr == pytest.approx(1e-2)
    assert stats.grad_norm > 0 and math.isfinite(stats.grad_norm)
    assert make_backend().update(seqs).ref_kl is None  # beta 0: no reference pass


def test_update_moves_each_sequence_with_its_advantage(make_backend):
    backend = make_backend()
    seqs = _sequences()
    before = [sum(lp) for lp in backend.logprobs(seqs)]
    stats = backend.update(_with_behaviour(seqs, backend.logprobs(seqs)))
    after = [sum(lp) for lp in backend.logprobs(seqs)]
    assert after[0] > before[0] and after[1] < before[1]  # A = +1 up, A = -1 down
    assert math.isfinite(stats.loss)
    with pytest.raises(ValueError):
        backend.update([])


def test_mismatch_kl_measures_the_behaviour_gap(make_backend):
    """Behaviour logprobs 0.5 nats below the trainer's: k3 = e^0.5 - 1 - 0.5 per token."""
    backend = make_backend()
    seqs = _sequences()
    shifted = [[x - 0.5 for x in lp] for lp in backend.logprobs(seqs)]
    stats = backend.update(_with_behaviour(seqs, shifted))
    assert stats.mismatch_kl == pytest.approx(math.exp(0.5) - 1.5, rel=1e-4)
    assert stats.per_sequence_mismatch_kl == pytest.approx([math.exp(0.5) - 1.5] * 4, rel=1e-4)


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
def test_micro_batches_give_the_full_batch_update(make_backend, aggregation):
    """The same loss, norm and LoRA gradients (to float32 rounding; not the weights after the
    AdamW step, where Adam's g / (|g| + eps) turns the layouts' different summation orders into
    +-lr in entries whose gradient is within rounding of zero), on a random adapter."""
    seqs = _sequences()
    results = []
    for micro in (0, 1, 3):
        backend = make_backend(loss_aggregation=aggregation, micro_batch_size=micro,
                               kl_beta=0.05)
        backend.load_adapter_files(random_adapter(backend.adapter_files(), seed=7))
        grads = capture_gradients(backend)
        results.append((backend.update(seqs), grads))
    (ref, ref_grads), *others = results
    assert len(ref_grads) == 2 * 7 * 2 and all(np.abs(g).max() > 0 for g in ref_grads.values())
    for stats, grads in others:
        assert stats.loss == pytest.approx(ref.loss, rel=1e-5, abs=1e-7)
        assert stats.grad_norm == pytest.approx(ref.grad_norm, rel=1e-4)
        assert grads.keys() == ref_grads.keys()
        for key, want in ref_grads.items():
            assert_close_to_largest(grads[key], want, ROUNDING_REL, str(key))


def test_adapter_files_are_peft_files(make_backend, tiny_llama_dir, tmp_path):
    import torch
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from gridrl.adapters import convert_files

    backend = make_backend(lora_target_modules="q_proj,v_proj")
    backend.update(_sequences())  # B is no longer zero
    files = backend.adapter_files()
    assert set(files) == {"adapter_config.json", "adapter_model.safetensors"}
    config = json.loads(files["adapter_config.json"])
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (
        RANK, ALPHA, ["q_proj", "v_proj"])
    assert config["base_model_name_or_path"] == str(tiny_llama_dir)
    (tmp_path / "adapter").mkdir()
    for name, data in files.items():
        (tmp_path / "adapter" / name).write_bytes(data)
    model_cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    hidden = model_cfg["hidden_size"]
    out_features = {"q_proj": hidden,
                    "v_proj": model_cfg["num_key_value_heads"] * model_cfg["head_dim"]}
    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "np") as f:
        assert f.metadata() == {"format": "pt"}
        names = f.keys()
        shapes = {k: f.get_tensor(k).shape for k in names}
        assert all(f.get_tensor(k).dtype == np.float32 for k in shapes)
    want = {}
    for layer in range(backend.identity.num_layers):
        for module, out in out_features.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            want[f"{prefix}.lora_A.weight"] = (RANK, hidden)
            want[f"{prefix}.lora_B.weight"] = (out, RANK)
    assert shapes == want
    # peft loads them onto the base model and computes what the backend computes
    seqs = _sequences()
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32),
        tmp_path / "adapter").eval()
    with torch.no_grad():
        s = seqs[1]
        ids = torch.tensor([list(s.prompt_ids) + list(s.completion_ids)])
        logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1]
        want = torch.log_softmax(logits, -1).gather(
            -1, torch.tensor(s.completion_ids)[:, None])[:, 0].numpy()
    np.testing.assert_allclose(backend.logprobs([s])[0], want, atol=1e-4)
    mlx = convert_files(files, "mlx", num_layers=backend.identity.num_layers)
    assert "adapters.safetensors" in mlx
    # another backend loading them holds the same policy; files of another shape do not fit
    other = make_backend(lora_target_modules="q_proj,v_proj", seed=9)
    other.load_adapter_files(files)
    np.testing.assert_allclose(_flat(other.logprobs(seqs)), _flat(backend.logprobs(seqs)),
                               atol=1e-6)
    with pytest.raises(ValueError):
        make_backend(lora_target_modules="q_proj").load_adapter_files(files)


def test_checkpoint_restores_adapter_optimizer_schedule_and_rng(make_backend):
    settings = dict(lr_schedule="linear", warmup_steps=2, steps=6, max_grad_norm=0.5)
    first, second = _sequences(seed=1), _sequences(seed=2)
    run = make_backend(seed=3, **settings)
    run.update(first)
    files = run.checkpoint_files()
    assert not RESERVED_CHECKPOINT_FILES & set(files)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(files)
    draws = (random.random(), float(np.random.rand()))
    want = run.update(second)

    resumed = make_backend(seed=4, **settings)  # another LoRA init and RNG streams
    resumed.restore_checkpoint(files)
    assert (random.random(), float(np.random.rand())) == draws
    got = resumed.update(second)
    assert got.lr == want.lr == pytest.approx(1e-2)  # second warmup step: the schedule resumed
    assert got.loss == pytest.approx(want.loss, rel=1e-6, abs=1e-9)
    assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-6)
    np.testing.assert_allclose(_flat(resumed.logprobs(first)), _flat(run.logprobs(first)),
                               atol=1e-6)
    # the adapter alone is not enough: without the optimizer and schedule the step differs
    adapter_only = make_backend(seed=4, **settings)
    adapter_only.load_adapter_files({k: v for k, v in files.items() if k.startswith("adapter_")})
    assert adapter_only.update(second).lr != want.lr
    assert not np.allclose(_flat(adapter_only.logprobs(first)), _flat(run.logprobs(first)),
                           atol=1e-6)


@pytest.mark.parametrize("settings, flag", [
    (dict(lora_target_modules="no_such_proj"), "--lora-target-modules"),
    (dict(device="tpu"), "--device"),
], ids=["target-modules", "device"])
def test_settings_the_backend_cannot_use_are_invalid_arguments(make_backend, settings, flag):

    from gridrl.common.errors import StatusError

    with pytest.raises(StatusError) as info:
        make_backend(**settings)
    assert info.value.kind is Kind.INVALID_ARGUMENT
    assert flag in info.value.message
