"""Model families end to end: tiny random llama, qwen2, qwen3, mistral (sliding window),
gemma2 (sliding window, tied embeddings) and phi3 (fused projections), each built here from its
transformers config, served by a real torch node (the lean forward for llama / qwen2 /
mistral, the model's own forward with transformers' cache for the others) and by an MLX node:
behaviour logprobs equal ``score`` at T=1 and T=0.7 + top-k, greedy tokens equal the model's
own uncached forward up to the context cap, a sliding window caps the context; one trainer
step on the node's and the local sampler's samples (their logprobs equal the trainer's), and
the trained adapter pushed in peft and in mlx-lm layout serves what the trainer's model gives.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from engine_helpers import (
    FAMILIES,
    make_peft_adapter,
    make_tiny_model,
    peft_reference,
    reference_greedy,
)
from rollout_helpers import LiveNode, push_files, rpc_error

from gridrl.adapters import build_manifest, convert_files
from gridrl.engine.contract import SamplingConfig

LEAN = {"llama", "qwen2", "mistral"}  # the lean forward's families; the rest: the fallback
WINDOW = 48  # sliding window of the tiny mistral and gemma2 (engine_helpers.FAMILIES)
#: a prompt that fills the context of a windowed family: 40 tokens + 8 new = the window
LONG_PROMPT = [5] + [(i * 7) % 400 + 20 for i in range(39)]
SHORT_PROMPT = [5, 7, 9, 2, 6]
CONFIGS = [SamplingConfig(max_tokens=8, temperature=1.0),
           SamplingConfig(max_tokens=8, temperature=0.7, top_k=20)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tiny_llama_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name = request.param
    return name, make_tiny_model(tmp_path_factory.mktemp(name) / "model", name, tiny_llama_dir)


@pytest.fixture(scope="module")
def torch_node(family, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveNode]:
    import torch

    from gridrl.engine.backends.torch.backend import TorchBackend

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    node = LiveNode(TorchBackend.from_pretrained(family[1]), tmp_path_factory.mktemp("node"))
    yield node
    node.close()
    torch.set_num_threads(before)


def _hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()


def _windowed(name: str) -> bool:
    return FAMILIES[name].get("sliding_window") is not None


def _assert_invariant(node: LiveNode, backend, prompts: list[list[int]], n: int,
                      max_tokens: int) -> None:
    """Each sampled token's behaviour logprob equals ``score`` of it (1e-4), T=1 and
    T=0.7 + top-k, prompts of different lengths."""
    for config in CONFIGS:
        for prompt in prompts:
            response = node.generate(prompt, n=n, max_tokens=max_tokens,
                                     temperature=config.temperature, top_k=config.top_k, seed=7)
            for sample in response.samples:
                scored = backend.score(prompt, list(sample.token_ids), config, None)
                assert scored == pytest.approx(list(sample.logprobs), abs=1e-4), config


def test_generate_on_a_torch_node(family, torch_node: LiveNode) -> None:
    name, model_dir = family
    backend = torch_node.engine.backend
    assert backend.forward_kind == ("lean" if name in LEAN else "transformers")
    context = WINDOW if _windowed(name) else 512
    assert torch_node.info().max_context == context
    _assert_invariant(torch_node, backend, [SHORT_PROMPT, LONG_PROMPT], n=3, max_tokens=8)
    # greedy up to the cap equals the model's own forward over the whole sequence (with its
    # sliding-window mask where it has one)
    want_tokens, want_logprobs = reference_greedy(_hf(model_dir), LONG_PROMPT, 8)
    sample = torch_node.generate(LONG_PROMPT, max_tokens=8, temperature=0).samples[0]
    assert list(sample.token_ids) == want_tokens
    assert list(sample.logprobs) == pytest.approx(want_logprobs, abs=1e-4)
    if _windowed(name):  # one token past the window is refused, naming the field
        e = rpc_error(lambda: torch_node.generate([*LONG_PROMPT, 9], max_tokens=8))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.details().startswith("sampling.max_tokens") and f"{WINDOW} tokens" in \
            e.details()


def test_trainer_step_then_its_adapter_pushed_in_peft_and_mlx_layout(
        family, torch_node: LiveNode) -> None:
    import torch

    from gridrl.engine.contract import SamplingConfig
    from gridrl.trainer.backends.base import TrainSequence, create_backend
    from gridrl.trainer.config import TrainConfig
    from gridrl.trainer.envs.episode import TurnRequest
    from gridrl.trainer.local import LocalRollout
    from gridrl.trainer.rollouts import group_seed

    name, model_dir = family
    backend = create_backend(TrainConfig(
        model=str(model_dir), lora_rank=4, lora_alpha=8, lr=0.05, max_tokens=6,
        temperature=1.0, seed=0, device="cpu", dtype="float32", rollout=["local"],
        run_dir="unused").finalize())
    policy = backend.policy
    # samples from the node (group 0) and from the trainer's own sampler (group 1)
    node_samples = torch_node.generate(SHORT_PROMPT, n=4, max_tokens=6, temperature=1.0,
                                       seed=3).samples
    local = LocalRollout(backend, lambda: 0).sample_turns(
        [TurnRequest(tuple(SHORT_PROMPT), group_seed(3, 0), 4, 6)],
        SamplingConfig(max_tokens=6, temperature=1.0))[0]
    seqs = [TrainSequence(tuple(SHORT_PROMPT), tuple(s.token_ids), tuple(s.logprobs),
                          advantage=float(i) - 1.5, group=g)
            for g, samples in enumerate((node_samples, local))
            for i, s in enumerate(samples)]
    stats = backend.update(seqs)
    assert stats.mismatch_kl < 1e-6  # both samplers' logprobs are the trainer's
    assert max(stats.per_sequence_mismatch_kl) < 1e-6
    assert stats.grad_norm > 0
    assert any(float(p.detach().abs().max()) > 0 for n, p in policy.model.named_parameters()
               if "lora_B" in n)
    policy.model.eval()
    with torch.no_grad():
        want_tokens, want_logprobs = reference_greedy(policy.model, SHORT_PROMPT, 6)
    peft_files = backend.adapter_files()
    layouts = {1: peft_files, 2: convert_files(peft_files, "mlx", num_layers=2)}
    for version, files in layouts.items():
        response = push_files(torch_node.stub, files, build_manifest(
            files, name=name, version=version).to_dict())
        assert response.serving.version == version and response.converted == (version == 2)
        sample = torch_node.generate(SHORT_PROMPT, max_tokens=6, temperature=0).samples[0]
        assert sample.adapter_version == version
        assert list(sample.token_ids) == want_tokens
        assert list(sample.logprobs) == pytest.approx(want_logprobs, abs=1e-4)


@pytest.mark.mlx
def test_an_mlx_node_serves_the_family(family, tmp_path: Path) -> None:
    """Few tokens: MLX on a Linux CPU is slow. A peft push is converted to mlx-lm and serves
    what peft gives (within float32 rounding across frameworks)."""
    pytest.importorskip("mlx.core")
    from gridrl.adapters import read_dir
    from gridrl.engine.backends.mlx.backend import MlxBackend

    name, model_dir = family
    backend = MlxBackend.from_pretrained(model_dir, device="cpu")
    node = LiveNode(backend, tmp_path / "node")
    try:
        assert node.info().max_context == (WINDOW if _windowed(name) else 512)
        _assert_invariant(node, backend, [SHORT_PROMPT, LONG_PROMPT], n=2, max_tokens=3)
        want_tokens, want_logprobs = reference_greedy(_hf(model_dir), LONG_PROMPT, 3)
        sample = node.generate(LONG_PROMPT, max_tokens=3, temperature=0).samples[0]
        assert list(sample.token_ids) == want_tokens
        assert list(sample.logprobs) == pytest.approx(want_logprobs, abs=1e-3)
        adapter = make_peft_adapter(model_dir, tmp_path / "lora", seed=4, std=0.2)
        want_tokens, want_logprobs = reference_greedy(peft_reference(model_dir, adapter),
                                                      SHORT_PROMPT, 3)
        files = read_dir(adapter)
        response = push_files(node.stub, files, build_manifest(files, name=name,
                                                               version=1).to_dict())
        assert response.converted and response.serving.version == 1
        sample = node.generate(SHORT_PROMPT, max_tokens=3, temperature=0).samples[0]
        assert list(sample.token_ids) == want_tokens
        assert list(sample.logprobs) == pytest.approx(want_logprobs, abs=1e-3)
    finally:
        node.close()
