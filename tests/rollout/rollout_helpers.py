"""Helpers shared by the rollout (node) tests (imported as ``rollout_helpers``); the model
helpers (prompts, peft references) are in ``tests/engine_helpers.py``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from engine_helpers import PROMPT

from gridrl.common.rpc.channel import dial
from gridrl.common.transport import push_requests
from gridrl.engine.contract import (
    Backend,
    DecodeInterrupted,
    DecodeObserver,
    SequenceRequest,
    SequenceResult,
)
from gridrl.rollout.server import NodeConfig, RolloutNode
from gridrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc


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

    def generate(self, batch: list[SequenceRequest], adapter: Any | None,
                 observer: DecodeObserver | None = None) -> list[SequenceResult]:
        self.entered += 1
        deadline = time.monotonic() + 60
        while not self.gate.wait(0.01):  # an interruption lets a held batch go on, to stop
            if observer is not None and observer.interrupted():  # at its first step
                break
            assert time.monotonic() < deadline, "test never opened the gate"
        return self.inner.generate(batch, adapter, observer)

    def load_adapter(self, directory: Path, key: str) -> Any:
        return self.inner.load_adapter(directory, key)

    def unload_adapter(self, adapter: Any) -> None:
        self.inner.unload_adapter(adapter)

    def score(self, prompt_ids, completion_ids, sampling, adapter):
        return self.inner.score(prompt_ids, completion_ids, sampling, adapter)


class SlowBackend(GatedBackend):
    """A real backend whose decoding is made long and slow by a test observer, so a test can
    act while a generation is in progress without racing it.

    Every decode step pauses ``step_s`` seconds (the backend's observer is wrapped). From step
    ``hold_from`` of the first ``generate`` call on, the call waits until it is interrupted
    (the engine's observer says so): a generation that cannot end by itself. With ``stall``
    cleared, a step blocks on it instead, ignoring interruptions (a step slower than any
    deadline). ``stepped`` is set once the first call has decoded ``hold_from`` steps;
    ``outcomes`` holds "done" or "interrupted" per call."""

    def __init__(self, inner: Backend, step_s: float = 0.01, hold_from: int | None = 3) -> None:
        super().__init__(inner)
        self.gate.set()
        self.step_s = step_s
        self.hold_from = hold_from
        self.stepped = threading.Event()
        self.stall = threading.Event()
        self.stall.set()
        self.stalled = threading.Event()
        self.outcomes: list[str] = []
        self._pause = threading.Event()  # never set: Event.wait is the per-step pause

    def generate(self, batch: list[SequenceRequest], adapter: Any | None,
                 observer: DecodeObserver | None = None) -> list[SequenceResult]:
        first = self.entered == 0
        self.entered += 1
        slow = _SlowObserver(self, observer, hold=first and self.hold_from is not None)
        try:
            results = self.inner.generate(batch, adapter, slow)
        except DecodeInterrupted:
            self.outcomes.append("interrupted")
            raise
        self.outcomes.append("done")
        return results


class _SlowObserver:
    def __init__(self, backend: SlowBackend, inner: DecodeObserver | None, hold: bool) -> None:
        self.backend, self.inner, self.hold, self.steps = backend, inner, hold, 0

    def on_tokens(self, rows, token_ids, logprobs) -> None:
        b = self.backend
        self.steps += 1
        if self.inner is not None:
            self.inner.on_tokens(rows, token_ids, logprobs)
        if not b.stall.is_set():
            b.stalled.set()
            assert b.stall.wait(60), "test never released the stalled step"
        b._pause.wait(b.step_s)
        if self.hold and self.steps >= b.hold_from:
            b.stepped.set()
            while not self.interrupted():
                b._pause.wait(b.step_s)

    def interrupted(self) -> bool:
        return self.inner is not None and self.inner.interrupted()


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



