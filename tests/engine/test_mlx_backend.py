"""MlxBackend against base.py's contract: exact behaviour logprobs, per-sequence seeds,
parity with transformers, and mlx-lm LoRA adapters next to the base weights."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import chat_ids, write_mlx_adapter

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from gridrl.engine.contract import (  # noqa: E402
    AdapterLoadError,
    SamplingConfig,
    SequenceRequest,
)
from gridrl.engine.threads import release_thread_state  # noqa: E402

pytestmark = pytest.mark.mlx

TOL = 1e-4  # logprob agreement (natural log), fp32

CONFIGS = {
    "greedy": SamplingConfig(max_tokens=8, temperature=0.0),
    "t1": SamplingConfig(max_tokens=8, temperature=1.0),
    "t0.7-top_k": SamplingConfig(max_tokens=8, temperature=0.7, top_k=20),
    "top_p0.9": SamplingConfig(max_tokens=8, temperature=1.0, top_p=0.9),
}


@pytest.fixture(scope="module")
def backend(tiny_llama_dir: Path):
    from gridrl.engine.backends.mlx.backend import MlxBackend

    return MlxBackend.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def prompts(backend) -> list[list[int]]:
    """Three prompts of different lengths (9, 3 and 14 tokens)."""
    tok = backend.tokenizer
    return [chat_ids(tok, "reverse the words : cat dog"), [1, 20, 30],
            chat_ids(tok, "the red cat and the blue dog run to the sea")]


def hf_model(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_log_softmax(model, prompt: list[int], completion: list[int]) -> list[float]:
    """log_softmax of transformers' fp32 logits at each completion token (temperature 1)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return [float(lp[i, t]) for i, t in enumerate(completion)]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Plain transformers forward loop: full sequence each step, argmax of the last logits."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


# -- the sampling transform itself ---------------------------------------------------------


def test_transform_matches_hand_computed_cases():
    from gridrl.engine.backends.mlx.sampling import transform_logits

    probs = np.log(np.array([[0.6, 0.3, 0.1]], np.float32))
    logits = mx.array(probs)

    def lp(**kw):
        cfg = SamplingConfig(max_tokens=1, **kw)
        return np.array(transform_logits(logits, [cfg]))[0]

    np.testing.assert_allclose(lp(temperature=0.0), probs[0], atol=1e-6)
    np.testing.assert_allclose(lp(temperature=1.0), probs[0], atol=1e-6)
    # top-p 0.7: 0.6 < 0.7 <= 0.9 -> the two largest, renormalized.
    got = lp(temperature=1.0, top_p=0.7)
    np.testing.assert_allclose(got[:2], np.log([2 / 3, 1 / 3]), atol=1e-6)
    assert got[2] == -math.inf
    # top-p 0.5: the largest alone already has mass >= 0.5.
    got = lp(temperature=1.0, top_p=0.5)
    assert got[0] == pytest.approx(0.0, abs=1e-6) and np.all(got[1:] == -math.inf)
    # temperature 0.5 squares the probabilities before renormalizing.
    sq = np.array([0.36, 0.09, 0.01])
    np.testing.assert_allclose(lp(temperature=0.5), np.log(sq / sq.sum()), atol=1e-5)
    # greedy ignores top-k / top-p (logprob under temperature 1, nothing removed).
    np.testing.assert_allclose(lp(temperature=0.0, top_k=1, top_p=0.1), probs[0], atol=1e-6)

    # top-k keeps ties at the k-th value.
    tied = mx.array([[1.0, 2.0, 2.0, 0.0]])
    got = np.array(transform_logits(tied, [SamplingConfig(1, 1.0, top_k=1)]))[0]
    np.testing.assert_allclose(got[1:3], np.log([0.5, 0.5]), atol=1e-6)
    assert got[0] == -math.inf and got[3] == -math.inf


def test_transform_matches_numpy_reference_per_row():
    """Rows with different configs in one call equal a direct numpy transcription of base.py."""
    from gridrl.engine.backends.mlx.sampling import transform_logits

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((5, 64)) * 3).astype(np.float32)
    configs = [SamplingConfig(1, 0.0), SamplingConfig(1, 1.3), SamplingConfig(1, 0.7, top_k=5),
               SamplingConfig(1, 0.9, top_p=0.8), SamplingConfig(1, 1.0, top_k=10, top_p=0.6)]

    def reference(x: np.ndarray, c: SamplingConfig) -> np.ndarray:
        x = x.astype(np.float64)
        if c.temperature == 0:
            return x - np.log(np.exp(x - x.max()).sum()) - x.max()
        z = x / c.temperature
        if 0 < c.top_k < len(z):
            z = np.where(z >= np.sort(z)[::-1][c.top_k - 1], z, -np.inf)
        if c.top_p < 1:
            order = np.argsort(-z)
            p = np.exp(z[order] - z[order][0])
            p /= p.sum()
            m = int(np.searchsorted(np.cumsum(p), c.top_p) + 1)  # smallest prefix >= top_p
            keep = np.zeros(len(z), bool)
            keep[order[:m]] = True
            z = np.where(keep, z, -np.inf)
        return z - (np.log(np.exp(z - z.max()).sum()) + z.max())

    got = np.array(transform_logits(mx.array(logits), configs))
    for row, c in enumerate(configs):
        want = reference(logits[row], c)
        assert np.array_equal(np.isinf(got[row]), np.isinf(want)), c
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[row][finite], want[finite], atol=1e-5)


# -- 1. the logprob invariant --------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_generate_logprobs_equal_score(backend, prompts, name):
    cfg = CONFIGS[name]
    batch = [SequenceRequest(p, cfg, seed=100 + i) for i, p in enumerate(prompts)]
    results = backend.generate(batch, None)
    assert len(results) == len(batch)
    for req, res in zip(batch, results, strict=True):
        assert len(res.token_ids) == len(res.logprobs) >= 1
        assert res.finish_reason == ("stop" if res.token_ids[-1] in backend.eos_token_ids
                                     else "length")
        assert all(math.isfinite(x) and x <= 0 for x in res.logprobs)
        scored = backend.score(req.prompt_ids, res.token_ids, cfg, None)
        np.testing.assert_allclose(res.logprobs, scored, atol=TOL, rtol=0)
    if name == "t0.7-top_k":  # the support of the first token is exactly the top 20
        first = [backend.score(prompts[0], [t], cfg, None)[0]
                 for t in range(backend.identity.vocab_size)]
        assert sum(math.isfinite(x) for x in first) == 20
        assert math.fsum(math.exp(x) for x in first) == pytest.approx(1.0, abs=1e-5)
        assert math.isfinite(first[results[0].token_ids[0]])


def test_stop_ids_and_max_tokens_per_sequence(backend, prompts):
    greedy = backend.generate([SequenceRequest(prompts[0], CONFIGS["greedy"], 0)], None)[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 8
    stop = greedy.token_ids[3]
    first = greedy.token_ids.index(stop)
    cfg = SamplingConfig(max_tokens=8, temperature=0.0, stop_token_ids=(stop,))
    batch = [SequenceRequest(prompts[0], cfg, 0),
             SequenceRequest(prompts[1], SamplingConfig(2, 1.0), 1),
             SequenceRequest(prompts[2], SamplingConfig(6, 0.7, top_k=30), 2)]
    res = backend.generate(batch, None)
    assert res[0].token_ids == greedy.token_ids[:first + 1] and res[0].finish_reason == "stop"
    np.testing.assert_allclose(res[0].logprobs, greedy.logprobs[:first + 1], atol=1e-5)
    assert [len(r.token_ids) for r in res[1:]] == [2, 6]
    assert [r.finish_reason for r in res[1:]] == ["length", "length"]


# -- 2. seeds --------------------------------------------------------------------------------


def test_same_seed_same_tokens_regardless_of_batch(backend, prompts):
    cfg = CONFIGS["t1"]
    alone = backend.generate([SequenceRequest(prompts[0], cfg, seed=7)], None)[0]
    mixed = backend.generate([
        SequenceRequest(prompts[2], CONFIGS["top_p0.9"], seed=1),
        SequenceRequest(prompts[1], SamplingConfig(3, 1.0), seed=2),  # finishes early
        SequenceRequest(prompts[0], cfg, seed=7),
        SequenceRequest(prompts[0], cfg, seed=8),
        SequenceRequest(prompts[0], cfg, seed=7),
    ], None)
    for res in (mixed[2], mixed[4]):
        assert res.token_ids == alone.token_ids
        np.testing.assert_allclose(res.logprobs, alone.logprobs, atol=1e-5, rtol=0)
    again = backend.generate([SequenceRequest(prompts[0], cfg, seed=7)], None)[0]
    assert again.token_ids == alone.token_ids and again.logprobs == alone.logprobs


def test_sequence_at_a_time_fallback_equals_batched(backend, prompts, monkeypatch):
    """For cache types mlx-lm cannot merge, sequences decode one by one: same samples."""
    batch = [SequenceRequest(prompts[i % 3], CONFIGS[name], seed=i)
             for i, name in enumerate(["t1", "greedy", "t1", "top_p0.9", "t0.7-top_k"])]
    batched = backend.generate(batch, None)
    monkeypatch.setattr(backend, "_can_merge", lambda cache: False)
    alone = backend.generate(batch, None)
    for a, b in zip(alone, batched, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_different_seeds_give_different_samples(backend, prompts):
    batch = [SequenceRequest(prompts[0], CONFIGS["t1"], seed=s) for s in range(6)]
    samples = {tuple(r.token_ids) for r in backend.generate(batch, None)}
    assert len(samples) == 6
    big = backend.generate([SequenceRequest(prompts[0], CONFIGS["t1"], seed=2**64 - 1)], None)
    assert len(big[0].token_ids) == 8


def test_generate_from_another_thread(backend, prompts):
    """The engine calls from its scheduler thread, not the one that loaded the model."""
    batch = [SequenceRequest(p, CONFIGS["t1"], seed=i) for i, p in enumerate(prompts)]
    here = backend.generate(batch, None)
    there: list = []

    def work() -> None:
        try:
            there.append(backend.generate(batch, None))
        finally:
            release_thread_state()

    worker = threading.Thread(target=work)
    worker.start()
    worker.join(120)
    assert there and [r.token_ids for r in there[0]] == [r.token_ids for r in here]


def test_release_thread_state_frees_the_threads_streams_only():
    """A thread's MLX streams are gone after release_thread_state (MLX's remedy for threads
    whose streams, torn down at thread exit, can abort the process: gridrl.engine.threads);
    the main thread's are kept, and a new thread decodes afresh."""
    seen: list[str] = []

    def work() -> None:
        stream = mx.new_stream(mx.cpu)
        with mx.stream(stream):
            seen.append(str(mx.sum(mx.arange(4)).item()))
        release_thread_state()
        try:
            with mx.stream(stream):
                mx.eval(mx.arange(4))
        except RuntimeError as e:
            seen.append(str(e))

    for _ in range(2):
        worker = threading.Thread(target=work)
        worker.start()
        worker.join(60)
    assert seen[0] == seen[2] == "6" and "no Stream" in seen[1] and "no Stream" in seen[3], seen
    release_thread_state()  # on the main thread: nothing is freed
    assert mx.sum(mx.arange(4)).item() == 6


# -- 3. parity with transformers -------------------------------------------------------------


def test_score_and_greedy_match_transformers(backend, prompts, tiny_llama_dir):
    model = hf_model(tiny_llama_dir)
    for prompt in prompts:
        completion = [40, 7, 300, 2, 511, 16]
        mine = backend.score(prompt, completion, SamplingConfig(8, 1.0), None)
        np.testing.assert_allclose(mine, hf_log_softmax(model, prompt, completion), atol=TOL)
    greedy = backend.generate([SequenceRequest(p, SamplingConfig(8, 0.0, stop_token_ids=()), 0)
                               for p in prompts], None)
    for prompt, res in zip(prompts, greedy, strict=True):
        want = hf_greedy(model, prompt, 8)
        n = len(res.token_ids)  # shorter only if eos was produced, which transformers shows too
        assert res.token_ids == want[:n]


def test_rope_parameters_of_transformers5_configs_are_honoured(tmp_path, tiny_llama_dir):
    """transformers 5 nests rope_theta under rope_parameters; mlx-lm alone would use 10000."""
    import shutil

    from gridrl.engine.backends.mlx.backend import MlxBackend

    d = tmp_path / "tiny-theta"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    assert "rope_theta" not in cfg and cfg["rope_parameters"]["rope_theta"] == 10000.0
    cfg["rope_parameters"]["rope_theta"] = 50.0  # far from 10000: positions matter a lot
    (d / "config.json").write_text(json.dumps(cfg))
    backend = MlxBackend.from_pretrained(d)
    model = hf_model(d)
    prompt, completion = [1, 20, 30, 40, 50, 60, 70, 80], [90, 100, 110, 120]
    mine = backend.score(prompt, completion, SamplingConfig(4, 1.0), None)
    np.testing.assert_allclose(mine, hf_log_softmax(model, prompt, completion), atol=TOL)


# -- 4. adapters -----------------------------------------------------------------------------


def reference_logprobs(model_dir: Path, adapter_dir: Path | None, prompt: list[int],
                       completion: list[int]) -> list[float]:
    """Temperature-1 logprobs from ``mlx_lm.load(model_dir, adapter_path=adapter_dir)``."""
    import mlx_lm

    model, _ = mlx_lm.load(str(model_dir),
                           adapter_path=str(adapter_dir) if adapter_dir else None)
    logits = model(mx.array([prompt + completion]))[0, len(prompt) - 1:-1].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return [float(lp[i, t]) for i, t in enumerate(completion)]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mlx-adapters")
    return {
        "a": write_mlx_adapter(root / "a", tiny_llama_dir, rank=4, scale=2.0, num_layers=1,
                               keys=["self_attn.q_proj", "self_attn.v_proj"], seed=1),
        "b": write_mlx_adapter(root / "b", tiny_llama_dir, rank=8, scale=1.5, num_layers=2,
                               keys=["self_attn.o_proj", "mlp.down_proj", "mlp.up_proj"],
                               seed=2),
        # no "keys": every Linear of the blocks, as mlx-lm does; num_layers -1: every block
        "c": write_mlx_adapter(root / "c", tiny_llama_dir, rank=2, scale=3.0, num_layers=-1,
                               keys=["self_attn.q_proj", "self_attn.k_proj",
                                     "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                                     "mlp.up_proj", "mlp.down_proj"], seed=3,
                               config_edit=lambda c: c["lora_parameters"].pop("keys")),
    }


def test_adapters_match_mlx_lm_and_alternate(tiny_llama_dir, prompts, adapters):
    from gridrl.engine.backends.mlx.backend import MlxBackend

    backend = MlxBackend.from_pretrained(tiny_llama_dir)  # its own: adapters wrap layers
    prompt, completion = prompts[0], [40, 7, 300, 2, 511, 16]
    t1 = SamplingConfig(6, 1.0)
    ref = {k: reference_logprobs(tiny_llama_dir, adapters.get(k), prompt, completion)
           for k in ("base", "a", "b", "c")}
    base_before = backend.score(prompt, completion, t1, None)
    np.testing.assert_allclose(base_before, ref["base"], atol=TOL)
    for k in ("a", "b", "c"):  # the adapters really change the model
        assert max(abs(x - y) for x, y in zip(ref[k], ref["base"], strict=True)) > 0.05

    ha = backend.load_adapter(adapters["a"], "a")
    hb = backend.load_adapter(adapters["b"], "b")
    hc = backend.load_adapter(adapters["c"], "c")
    assert (ha.rank, hb.rank, hc.rank) == (4, 8, 2)
    assert (len(ha.modules), len(hb.modules), len(hc.modules)) == (2, 6, 14)
    for handle, k in [(ha, "a"), (None, "base"), (hb, "b"), (ha, "a"), (hc, "c"), (hb, "b"),
                      (None, "base"), (hc, "c")]:
        np.testing.assert_allclose(backend.score(prompt, completion, t1, handle), ref[k],
                                   atol=TOL, err_msg=k)
    # base weights untouched: exactly the logprobs from before any adapter was loaded
    assert backend.score(prompt, completion, t1, None) == base_before

    # generate under an adapter keeps the invariant against score under the same adapter
    for handle in (ha, hb):
        batch = [SequenceRequest(p, CONFIGS["top_p0.9"], seed=3) for p in prompts[:2]]
        for req, res in zip(batch, backend.generate(batch, handle), strict=True):
            np.testing.assert_allclose(
                res.logprobs, backend.score(req.prompt_ids, res.token_ids, req.sampling, handle),
                atol=TOL)

    backend.unload_adapter(ha)
    np.testing.assert_allclose(backend.score(prompt, completion, t1, hb), ref["b"], atol=TOL)
    with pytest.raises(ValueError, match="unloaded"):
        backend.score(prompt, completion, t1, ha)
    assert backend.score(prompt, completion, t1, None) == base_before


MISFITS = {
    "shape": (
        lambda c: None,
        lambda w: w.__setitem__("model.layers.1.self_attn.q_proj.lora_a", mx.zeros((65, 4))),
        r"model\.layers\.1\.self_attn\.q_proj\.lora_a: shape \(65, 4\) .* expected \(64, 4\)"),
    "unknown module": (
        lambda c: None,
        lambda w: w.__setitem__("model.layers.1.self_attn.qq_proj.lora_a", mx.zeros((64, 4))),
        r"qq_proj\.lora_a: the base model has no module model\.layers\.1\.self_attn\.qq_proj"),
    "too many layers": (
        lambda c: c.__setitem__("num_layers", 3), lambda w: None,
        r"num_layers=3 but the base model has 2 layers"),
    "rank mismatch in file": (
        lambda c: None,
        lambda w: w.update({"model.layers.1.self_attn.v_proj.lora_a": mx.zeros((64, 8)),
                            "model.layers.1.self_attn.v_proj.lora_b": mx.zeros((8, 32))}),
        r"v_proj\.lora_a: shape \(64, 8\) .* at rank 4: expected \(64, 4\)"),
    "layer not adapted": (
        lambda c: None,
        lambda w: w.__setitem__("model.layers.0.self_attn.q_proj.lora_a", mx.zeros((64, 4))),
        r"model\.layers\.0\.self_attn\.q_proj\.lora_a: layer 0 is not adapted"),
    "key not in config": (
        lambda c: None,
        lambda w: w.__setitem__("model.layers.1.mlp.up_proj.lora_a", mx.zeros((64, 4))),
        r"mlp\.up_proj is not in lora_parameters\.keys"),
    "half a pair": (
        lambda c: None, lambda w: w.pop("model.layers.1.self_attn.v_proj.lora_b"),
        r"model\.layers\.1\.self_attn\.v_proj\.lora_b is missing"),
    "alpha instead of scale": (
        lambda c: c.__setitem__("lora_parameters", {"rank": 4, "alpha": 16, "dropout": 0.0,
                                                    "keys": ["self_attn.q_proj"]}),
        lambda w: None,
        r"lora_parameters\.scale is missing \(found 'alpha'"),
    "dora": (
        lambda c: c.__setitem__("fine_tune_type", "dora"), lambda w: None,
        r"fine_tune_type 'dora' is not served"),
}


def test_misfit_adapters_raise_and_change_nothing(tiny_llama_dir, prompts, adapters,
                                                  tmp_path):
    from gridrl.engine.backends.mlx.backend import MlxBackend

    backend = MlxBackend.from_pretrained(tiny_llama_dir)
    prompt, completion, t1 = prompts[1], [40, 7, 300], SamplingConfig(3, 1.0)
    ha = backend.load_adapter(adapters["a"], "a")
    serving = backend.score(prompt, completion, t1, ha)
    base = backend.score(prompt, completion, t1, None)
    for name, (config_edit, weights_edit, pattern) in MISFITS.items():
        d = write_mlx_adapter(tmp_path / name.replace(" ", "-"), tiny_llama_dir, rank=4,
                              scale=2.0, num_layers=1,
                              keys=["self_attn.q_proj", "self_attn.v_proj"], seed=5,
                              config_edit=config_edit, weights_edit=weights_edit)
        with pytest.raises(AdapterLoadError, match=pattern):
            backend.load_adapter(d, name)
    with pytest.raises(AdapterLoadError, match=r"no adapter_config\.json"):
        backend.load_adapter(tmp_path / "nowhere", "nowhere")
    assert backend.score(prompt, completion, t1, ha) == serving
    assert backend.score(prompt, completion, t1, None) == base


# -- 5. the bundled SmolLM2-135M-Instruct ----------------------------------------------------


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_greedy_matches_transformers_and_invariant_holds(smollm2_dir):
    from gridrl.engine.backends.mlx.backend import MlxBackend

    backend = MlxBackend.from_pretrained(smollm2_dir)
    assert (backend.device, backend.dtype, backend.identity.num_layers) == ("mlx-cpu",
                                                                            "float32", 30)
    prompt = chat_ids(backend.tokenizer, "What is 2+2?")
    greedy = backend.generate([SequenceRequest(prompt, SamplingConfig(6, 0.0), 0)], None)[0]
    model = hf_model(smollm2_dir)
    assert greedy.token_ids == hf_greedy(model, prompt, 6)
    # Behaviour logprobs agree with transformers too (30 fp32 layers: a looser bound than the
    # tiny model's; a wrong RoPE base, for one, is off by ~0.4 here).
    np.testing.assert_allclose(greedy.logprobs,
                               hf_log_softmax(model, prompt, greedy.token_ids), atol=5e-4)

    cfg = SamplingConfig(max_tokens=4, temperature=0.8, top_p=0.9)
    short = chat_ids(backend.tokenizer, "Hi")
    batch = [SequenceRequest(prompt, cfg, seed=1), SequenceRequest(short, cfg, seed=2)]
    for req, res in zip(batch, backend.generate(batch, None), strict=True):
        np.testing.assert_allclose(
            res.logprobs, backend.score(req.prompt_ids, res.token_ids, cfg, None), atol=TOL)
