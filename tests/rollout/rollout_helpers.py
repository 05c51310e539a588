"""Helpers shared by the rollout tests (imported as ``rollout_helpers``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from gridrl.common.channel import dial
from gridrl.common.transport import push_requests
from gridrl.engine.contract import (
    Backend,
    Interrupted,
    SamplingConfig,
    SequenceRequest,
    SequenceResult,
)
from gridrl.rollout.server import NodeConfig, RolloutNode
from gridrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

PROMPT = [5, 7, 9, 2, 6]  # "<|user|> the cat </s> <|assistant|>" in the tiny tokenizer


def wait_until(pred: Callable[[], bool], timeout: float = 20.0, every: float = 0.01) -> None:
    """Poll ``pred`` until true; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(every)


class GatedBackend(Backend):
    """A real backend whose ``generate`` waits for ``gate`` (set by the test) before decoding,
    so a test can hold a batch in flight while it queues requests or pushes an adapter.
    ``entered`` counts calls that reached the gate."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.entered = 0
        for attr in ("name", "adapter_format", "device", "dtype", "identity", "tokenizer",
                     "eos_token_ids"):
            setattr(self, attr, getattr(inner, attr))
        self.vocab_size = getattr(inner, "vocab_size", inner.identity.vocab_size)

    def generate(self, batch: list[SequenceRequest], adapter: Any | None) -> list[SequenceResult]:
        self.entered += 1
        assert self.gate.wait(60), "test never opened the gate"
        return self.inner.generate(batch, adapter)

    def interrupt(self, on: bool = True) -> None:
        super().interrupt(on)
        self.inner.interrupt(on)
        if on:
            self.gate.set()  # a batch held at the gate goes on, to stop at its first step

    def load_adapter(self, directory: Path, key: str) -> Any:
        return self.inner.load_adapter(directory, key)

    def unload_adapter(self, adapter: Any) -> None:
        self.inner.unload_adapter(adapter)

    def score(self, prompt_ids, completion_ids, sampling, adapter):
        return self.inner.score(prompt_ids, completion_ids, sampling, adapter)


class LiveNode:
    """An in-process rollout node on loopback with a client stub."""

    def __init__(self, backend: Backend, tmp_path: Path, **config: Any) -> None:
        config.setdefault("adapter_root", tmp_path / "adapters")
        config.setdefault("grace_s", 2.0)
        self.node = RolloutNode(backend, NodeConfig(listen="127.0.0.1:0", **config)).start()
        self.channel = dial(self.node.address)
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)

    @property
    def engine(self):
        return self.node.engine

    def generate(self, prompt: list[int] | None = None, timeout: float = 60, **sampling: Any
                 ) -> rollout_pb2.GenerateResponse:
        sampling.setdefault("max_tokens", 8)
        return self.stub.Generate(rollout_pb2.GenerateRequest(
            prompt_token_ids=prompt or PROMPT, sampling=common_pb2.SamplingParams(**sampling)),
            timeout=timeout)

    def info(self) -> common_pb2.NodeInfo:
        return self.stub.GetNodeInfo(rollout_pb2.GetNodeInfoRequest(), timeout=10).info

    def close(self) -> None:
        self.channel.close()
        self.node.stop(1.0)


def push_files(stub, files: dict[str, bytes], manifest: dict, *, stage_only: bool = False,
               timeout: float = 60) -> rollout_pb2.PushAdapterResponse:
    """PushAdapter with the shared transport's stream."""
    return stub.PushAdapter(push_requests(manifest, files, stage_only=stage_only,
                                          chunk_size=4096), timeout=timeout)


def push_dir(stub, directory: Path, name: str, version: int, **kw: Any
             ) -> rollout_pb2.PushAdapterResponse:
    from gridrl.adapters import build_manifest, read_dir

    files = read_dir(directory)
    return push_files(stub, files, build_manifest(files, name=name, version=version).to_dict(),
                      **kw)


def make_peft_adapter(base_dir: Path, out: Path, seed: int = 1, targets: Any = "all-linear",
                      rank: int = 4, alpha: float = 8.0, std: float | None = None) -> Path:
    """Save a random, non-zero peft LoRA for the model in ``base_dir`` (an adapter "trained
    elsewhere"). ``std`` rescales A and B to that standard deviation (None: peft's init)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir))
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha,
                                                  target_modules=targets,
                                                  init_lora_weights=False))
    if std is not None:
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, std)
    peft_model.save_pretrained(str(out))
    return out


def peft_reference(base_dir: Path, adapter_dir: Path | None) -> Any:
    """The base model with ``adapter_dir`` loaded by peft (or the plain model), eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir)).eval()
    return PeftModel.from_pretrained(model, str(adapter_dir)).eval() if adapter_dir else model


def reference_greedy(model: Any, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens by full forwards (no cache) and their log_softmax logprobs."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], reference_logprobs(model, prompt, ids[len(prompt):])


def reference_logprobs(model: Any, prompt: list[int], completion: list[int]) -> list[float]:
    """Teacher-forced log_softmax logprobs of ``completion`` (temperature 1, no truncation)."""
    import torch

    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0].tolist()


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as one user message in the tokenizer's chat template."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def rpc_error(fn: Callable[[], Any]) -> grpc.RpcError:
    """Call ``fn`` and return the RpcError it raises (AssertionError if none)."""
    try:
        fn()
    except grpc.RpcError as e:
        return e
    raise AssertionError("expected an RpcError")


def tree(root: Path) -> list[str]:
    """Every path under ``root`` (relative, sorted), hidden ones included."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))



def check_interrupt_between_steps(backend: Backend, prompt: list[int]) -> None:
    """``backend.interrupt()`` called while a 20-token ``generate`` runs (from its third
    ``check_interrupted``: after the prefill and one decode step) ends that call with
    :class:`Interrupted` at the next check; ``interrupt(False)`` makes it decode again."""
    request = SequenceRequest(prompt, SamplingConfig(max_tokens=20, temperature=0.0), seed=0)
    checks = 0
    real_check = backend.check_interrupted

    def check() -> None:
        nonlocal checks
        checks += 1
        if checks == 3:
            backend.interrupt()
        real_check()

    backend.check_interrupted = check  # type: ignore[method-assign]
    try:
        try:
            backend.generate([request, request], None)
        except Interrupted:
            pass
        else:
            raise AssertionError("generate did not stop when interrupted")
        assert checks == 3  # stopped at the first check after the interrupt
    finally:
        del backend.check_interrupted
        backend.interrupt(False)
    (result, _) = backend.generate([request, request], None)
    assert len(result.token_ids) == 20 or result.finish_reason == "stop"
