"""TorchBackend on the tiny llama: the logprob invariant, batch independence of seeded samples,
stop tokens, peft adapters next to each other, and in-process use over a peft model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import PROMPT, peft_reference, reference_greedy

from gridrl.engine.contract import AdapterLoadError, SamplingConfig, SequenceRequest

PROMPTS = [PROMPT, [10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
CONFIGS = {
    "t1": SamplingConfig(max_tokens=10, temperature=1.0),
    "t0.7-topk": SamplingConfig(max_tokens=10, temperature=0.7, top_k=20),
    "topp": SamplingConfig(max_tokens=10, temperature=1.0, top_p=0.8),
    "topk-topp": SamplingConfig(max_tokens=10, temperature=1.2, top_k=40, top_p=0.6),
    "greedy": SamplingConfig(max_tokens=10, temperature=0.0),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logprob_invariant(tiny_backend, name: str) -> None:
    """Each behaviour logprob equals the teacher-forced logprob of its token under the same
    transform (within 1e-4 in fp32), for prompts of different lengths decoded together."""
    config = CONFIGS[name]
    batch = [SequenceRequest(PROMPTS[i % 3], config, seed=100 + i) for i in range(6)]
    results = tiny_backend.generate(batch, None)
    for req, res in zip(batch, results, strict=True):
        assert len(res.token_ids) == len(res.logprobs) >= 1
        scored = tiny_backend.score(req.prompt_ids, res.token_ids, config, None)
        assert max(abs(a - b) for a, b in zip(scored, res.logprobs, strict=True)) < 1e-4
        assert all(lp <= 0 and lp != float("-inf") for lp in res.logprobs)


def test_mixed_configs_in_one_batch(tiny_backend) -> None:
    batch = [SequenceRequest(PROMPTS[i % 3], list(CONFIGS.values())[i % 5], seed=7 + i)
             for i in range(10)]
    results = tiny_backend.generate(batch, None)
    for req, res in zip(batch, results, strict=True):
        scored = tiny_backend.score(req.prompt_ids, res.token_ids, req.sampling, None)
        assert max(abs(a - b) for a, b in zip(scored, res.logprobs, strict=True)) < 1e-4


def test_seeded_samples_do_not_depend_on_the_batch(tiny_backend) -> None:
    batch = [SequenceRequest(PROMPTS[i % 3], list(CONFIGS.values())[i % 5], seed=40 + i)
             for i in range(10)]
    together = tiny_backend.generate(batch, None)
    alone = [tiny_backend.generate([req], None)[0] for req in batch]
    reversed_batch = tiny_backend.generate(batch[::-1], None)[::-1]
    for a, b, c in zip(together, alone, reversed_batch, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    # different seeds give different samples
    other = tiny_backend.generate([SequenceRequest(PROMPT, CONFIGS["t1"], seed=s)
                                   for s in range(4)], None)
    assert len({tuple(r.token_ids) for r in other}) > 1


def test_cache_growth_does_not_change_samples(tiny_backend, monkeypatch) -> None:
    """The KV buffers start small and double; samples are the same as with room for all."""
    from gridrl.engine.backends.torch import cache as torch_cache

    batch = [SequenceRequest(PROMPTS[i % 3], list(CONFIGS.values())[i % 5], seed=60 + i)
             for i in range(8)]
    roomy = tiny_backend.generate(batch, None)
    monkeypatch.setattr(torch_cache, "FIRST_BLOCK", 1)
    tight = tiny_backend.generate(batch, None)
    for a, b in zip(roomy, tight, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_greedy_matches_a_plain_forward_loop(tiny_backend, tiny_llama_dir: Path) -> None:
    ref_tokens, ref_lps = reference_greedy(peft_reference(tiny_llama_dir, None), PROMPT, 10)
    res = tiny_backend.generate([SequenceRequest(PROMPT, CONFIGS["greedy"], seed=0)], None)[0]
    assert res.token_ids == ref_tokens
    assert res.logprobs == pytest.approx(ref_lps, abs=1e-4)


def test_stop_tokens_and_lengths(tiny_backend) -> None:
    greedy = tiny_backend.generate([SequenceRequest(PROMPT, CONFIGS["greedy"], 0)], None)[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 10
    stop = greedy.token_ids[3]
    first = greedy.token_ids.index(stop)
    config = SamplingConfig(max_tokens=10, temperature=0.0, stop_token_ids=(stop,))
    short = SamplingConfig(max_tokens=2, temperature=0.0)
    res = tiny_backend.generate([SequenceRequest(PROMPT, config, 0),
                                 SequenceRequest(PROMPT, short, 0),
                                 SequenceRequest(PROMPT, CONFIGS["greedy"], 0)], None)
    assert res[0].finish_reason == "stop"
    assert res[0].token_ids == greedy.token_ids[:first + 1]  # the stop token is included
    assert res[1].finish_reason == "length" and res[1].token_ids == greedy.token_ids[:2]
    assert res[2].token_ids == greedy.token_ids  # rows that finished early do not disturb it
    # eos ends a sample too
    tiny_backend.eos_token_ids = frozenset({stop})
    res = tiny_backend.generate([SequenceRequest(PROMPT, CONFIGS["greedy"], 0)], None)[0]
    assert res.finish_reason == "stop" and res.token_ids == greedy.token_ids[:first + 1]


def test_adapters_load_next_to_each_other(tiny_backend, tiny_llama_dir: Path,
                                          tiny_adapters: dict[str, Path]) -> None:
    greedy = CONFIGS["greedy"]
    base = tiny_backend.generate([SequenceRequest(PROMPT, greedy, 0)], None)[0]
    a = tiny_backend.load_adapter(tiny_adapters["a"], "a")
    b = tiny_backend.load_adapter(tiny_adapters["b"], "b")
    for handle, name in ((a, "a"), (b, "b"), (a, "a")):
        ref_tokens, ref_lps = reference_greedy(
            peft_reference(tiny_llama_dir, tiny_adapters[name]), PROMPT, 10)
        res = tiny_backend.generate([SequenceRequest(PROMPT, greedy, 0)], handle)[0]
        assert res.token_ids == ref_tokens
        assert res.logprobs == pytest.approx(ref_lps, abs=1e-4)
        assert tiny_backend.score(PROMPT, ref_tokens, greedy, handle) == pytest.approx(
            ref_lps, abs=1e-4)
        assert res.token_ids != base.token_ids
    # adapter None is the base model, with adapters loaded
    assert tiny_backend.generate([SequenceRequest(PROMPT, greedy, 0)], None)[0] == base
    tiny_backend.unload_adapter(a)
    with pytest.raises(ValueError):
        tiny_backend.generate([SequenceRequest(PROMPT, greedy, 0)], a)
    tiny_backend.unload_adapter(b)
    assert tiny_backend.generate([SequenceRequest(PROMPT, greedy, 0)], None)[0] == base


def _corrupt_shape(src: Path, dst: Path) -> Path:
    """Copy a peft adapter with one lora_B made one row too tall."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "adapter_config.json").write_bytes((src / "adapter_config.json").read_bytes())
    tensors = load_file(src / "adapter_model.safetensors")
    key = next(k for k in sorted(tensors) if k.endswith("mlp.gate_proj.lora_B.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1])
    save_file(tensors, dst / "adapter_model.safetensors", metadata={"format": "pt"})
    return dst


def test_adapter_that_does_not_fit_changes_nothing(tiny_backend, tiny_adapters, tmp_path) -> None:
    greedy = CONFIGS["greedy"]
    a = tiny_backend.load_adapter(tiny_adapters["a"], "a")
    before = tiny_backend.generate([SequenceRequest(PROMPT, greedy, 0)], a)[0]
    bad = _corrupt_shape(tiny_adapters["a"], tmp_path / "bad")
    with pytest.raises(AdapterLoadError, match=r"gate_proj.*does not fit.*out_features 128"):
        tiny_backend.load_adapter(bad, "bad")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterLoadError, match="not a peft adapter"):
        tiny_backend.load_adapter(tmp_path / "empty", "empty")
    with pytest.raises(AdapterLoadError, match="already loaded"):
        tiny_backend.load_adapter(tiny_adapters["b"], "a")
    assert tiny_backend.generate([SequenceRequest(PROMPT, greedy, 0)], a)[0] == before


def test_adapter_files_in_memory_load_like_the_directory(tiny_backend, tiny_adapters,
                                                        tmp_path) -> None:
    """load_adapter_files (a push's path) serves what load_adapter of the same directory
    serves, from read-only bytes and from a push's writable bytearray, with the weights stored
    in bf16 too; a file that does not parse is refused and changes nothing."""
    from safetensors.torch import load_file, save

    greedy = CONFIGS["greedy"]
    files = {p.name: p.read_bytes() for p in tiny_adapters["a"].iterdir() if p.is_file()}
    from_dir = tiny_backend.load_adapter(tiny_adapters["a"], "dir")
    want = tiny_backend.generate([SequenceRequest(PROMPT, greedy, 0)], from_dir)[0]
    for key, data in (("bytes", files), ("bytearray",
                                         {k: bytearray(v) for k, v in files.items()})):
        handle = tiny_backend.load_adapter_files(data, key)
        assert tiny_backend.generate([SequenceRequest(PROMPT, greedy, 0)], handle)[0] == want
        tiny_backend.unload_adapter(handle)
    bf16 = {k: v.bfloat16() for k, v in
            load_file(tiny_adapters["a"] / "adapter_model.safetensors").items()}
    handle = tiny_backend.load_adapter_files(
        {**files, "adapter_model.safetensors": save(bf16, metadata={"format": "pt"})}, "bf16")
    got = tiny_backend.generate([SequenceRequest(PROMPT, greedy, 0)], handle)[0]
    assert got.token_ids == want.token_ids  # LoRA weights rounded to bf16: same greedy path
    assert got.logprobs == pytest.approx(want.logprobs, abs=5e-2)
    with pytest.raises(AdapterLoadError, match=r"adapter_model\.safetensors"):
        tiny_backend.load_adapter_files({**files, "adapter_model.safetensors": b"\x10" * 16},
                                        "corrupt")
    assert tiny_backend.generate([SequenceRequest(PROMPT, greedy, 0)], from_dir)[0] == want


def test_from_model_uses_the_peft_model_as_it_is(tiny_llama_dir: Path,
                                                 tiny_adapters: dict[str, Path]) -> None:
    """The trainer's in-process use: adapter=None decodes with the model's active adapter, in
    eval mode, and leaves the model in the mode it found it."""
    from gridrl.engine.backends.torch.backend import TorchBackend

    model = peft_reference(tiny_llama_dir, tiny_adapters["a"])
    ref_tokens, ref_lps = reference_greedy(model, PROMPT, 6)
    model.train()
    backend = TorchBackend.from_model(model, _tokenizer(tiny_llama_dir))
    config = SamplingConfig(max_tokens=6, temperature=0.0)
    res = backend.generate([SequenceRequest(PROMPT, config, 0)], None)[0]
    assert res.token_ids == ref_tokens
    assert res.logprobs == pytest.approx(ref_lps, abs=1e-4)
    assert model.training
    sampled = backend.generate([SequenceRequest(PROMPT, CONFIGS["t1"], 3)], None)[0]
    scored = backend.score(PROMPT, sampled.token_ids, CONFIGS["t1"], None)
    assert scored == pytest.approx(sampled.logprobs, abs=1e-4)


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
