"""Scripted rollout nodes for the pool / sync tests: a real ``RolloutService`` on a real
``GrpcServer`` whose behaviour the test drives (slow, failing, down, sleeping past deadlines),
and which records every Generate and PushAdapter it receives."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping

from gridrl.adapters import AdapterManifest
from gridrl.adapters.wire import adapter_format_to_proto
from gridrl.common.errors import Kind, StatusError, invalid_argument
from gridrl.common.rpc.server import GrpcServer
from gridrl.common.transport import receive_push
from gridrl.models import ModelIdentity
from gridrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from gridrl.v1.enums import enum_value

IDENTITY = {"architecture": "llama", "hidden_size": 64, "num_layers": 2, "vocab_size": 512}
# The trainer's base model in the pool / sync tests (the scripted nodes serve IDENTITY).
BASE = ModelIdentity(model_id="tiny", max_context=2048, **IDENTITY)
# Hang guard of a push_barrier (a push still alone after this long fails: BrokenBarrierError)
# and of a gate (a held Generate answers after this long).
BARRIER_TIMEOUT_S = 30.0
SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name


class ScriptedNode(rollout_pb2_grpc.RolloutServiceServicer):
    """A rollout node whose behaviour is set by attributes.

    Attributes the test sets: ``generate_s`` / ``push_s`` (seconds each call takes),
    ``down`` (every call fails UNAVAILABLE, like a sleeping laptop behind a live port),
    ``fail_generate`` (Generate fails UNAVAILABLE, GetNodeInfo still answers),
    ``adapter`` ((name, version) served), ``serve_after_push`` ((name, version) served after
    every push whatever it answered: a swap that silently failed), ``push_barrier`` (a push
    answers only once every node sharing the barrier has one in flight: proof of concurrent
    pushes without timing them), ``gate`` (when set to an Event, Generate answers only once
    it is set: a group held on the node for as long as the test needs). Records: ``generates``
    (requests), ``max_active``
    (most concurrent Generate calls), ``pushes`` (manifest dicts), ``pushed_files``, ``infos``
    (GetNodeInfo calls).
    """

    def __init__(self, *, capacity: int = 4, backend: str = "torch", adapter_format: str = "peft",
                 identity: Mapping[str, object] = IDENTITY, generate_s: float = 0.0,
                 push_s: float = 0.0, adapter: tuple[str, int] = ("", 0),
                 push_barrier: threading.Barrier | None = None) -> None:
        self.capacity = capacity
        self.backend = backend
        self.adapter_format = adapter_format
        self.identity = dict(identity)
        self.generate_s = generate_s
        self.push_s = push_s
        self.push_barrier = push_barrier
        self.gate: threading.Event | None = None
        self.adapter = adapter
        self.down = False
        self.fail_generate = False
        self.serve_after_push: tuple[str, int] | None = None
        self.address = ""
        self.generates: list[rollout_pb2.GenerateRequest] = []
        self.active = 0
        self.max_active = 0
        self.pushes: list[dict] = []
        self.pushed_files: list[dict[str, bytes]] = []
        self.reloads = 0
        self.infos = 0  # GetNodeInfo calls answered
        self._lock = threading.Lock()
        self._wake = threading.Event()  # set on stop: sleeping handlers return at once
        self.server: GrpcServer | None = None

    def start(self) -> ScriptedNode:
        self.server = GrpcServer("127.0.0.1:0", metrics_port=-1, grace_s=0)
        self.server.add(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, self, SERVICE)
        self.server.start()
        self.address = self.server.address
        return self

    def kill(self) -> None:
        """Stop the server at once; calls in flight are cancelled."""
        self._wake.set()
        if self.server is not None:
            self.server.stop(0)

    def _check_up(self) -> None:
        if self.down:
            raise StatusError(Kind.UNAVAILABLE, f"{self.address} is asleep")

    def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            self._wake.wait(seconds)

    def Generate(self, request, context):
        self._check_up()
        for i, token in enumerate(request.prompt_token_ids):
            if token >= self.identity["vocab_size"]:
                raise invalid_argument(f"prompt_token_ids[{i}]", f"{token} is outside the "
                                       f"vocabulary of {self.identity['vocab_size']}")
        with self._lock:
            self.generates.append(request)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            self._sleep(self.generate_s)
            if self.gate is not None:
                self.gate.wait(BARRIER_TIMEOUT_S)
            if self.fail_generate:
                raise StatusError(Kind.UNAVAILABLE, f"{self.address}: engine failed")
            name, version = self.adapter
            samples = [common_pb2.Sample(token_ids=[10 + i, 2], logprobs=[-0.5, -0.25],
                                         text=f"sample {i}",
                                         finish_reason=common_pb2.FINISH_REASON_STOP,
                                         adapter_version=version, adapter_name=name)
                       for i in range(request.sampling.n or 1)]
            return rollout_pb2.GenerateResponse(samples=samples,
                                                prompt_token_ids=request.prompt_token_ids,
                                                duration_s=self.generate_s)
        finally:
            with self._lock:
                self.active -= 1

    def PushAdapter(self, request_iterator, context):
        self._check_up()
        received = receive_push(request_iterator, max_bytes=64 << 20)
        if self.push_barrier is not None:
            self.push_barrier.wait(BARRIER_TIMEOUT_S)
        self._sleep(self.push_s)
        self._check_up()
        manifest = AdapterManifest.from_proto(received.manifest).to_dict()
        with self._lock:
            self.pushes.append(manifest)
            self.pushed_files.append(received.files)
            self.adapter = self.serve_after_push or (manifest["name"], manifest["version"])
        return rollout_pb2.PushAdapterResponse(
            serving=common_pb2.AdapterRef(name=manifest["name"], version=manifest["version"]),
            bytes_received=received.bytes_received)

    def ReloadAdapter(self, request, context):
        self._check_up()
        if request.WhichOneof("target") != "base_model":
            raise StatusError(Kind.UNIMPLEMENTED, "scripted node: base_model only")
        with self._lock:
            self.reloads += 1
            self.adapter = ("", 0)
        return rollout_pb2.ReloadAdapterResponse(serving=common_pb2.AdapterRef())

    def GetNodeInfo(self, request, context):
        self._check_up()
        with self._lock:
            self.infos += 1
        return rollout_pb2.GetNodeInfoResponse(info=self.info())

    def info(self) -> common_pb2.NodeInfo:
        name, version = self.adapter
        return common_pb2.NodeInfo(
            address=self.address, role=common_pb2.NODE_ROLE_ROLLOUT,
            backend=enum_value(common_pb2.Backend, self.backend), adapter_format=adapter_format_to_proto(self.adapter_format),
            base_model=common_pb2.BaseModel(model_id="tiny", **self.identity),
            adapter=common_pb2.AdapterRef(name=name, version=version), capacity=self.capacity,
            max_n=64, max_tokens=512, max_context=1024, device="cpu", dtype="float32")


class NodeFarm:
    """Starts scripted nodes; :meth:`close` kills them all."""

    def __init__(self) -> None:
        self.nodes: list[ScriptedNode] = []

    def start(self, **kw) -> ScriptedNode:
        node = ScriptedNode(**kw).start()
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for node in self.nodes:
            node.kill()


def peft_files(version_seed: int = 0) -> dict[str, bytes]:
    """A real (small) peft LoRA adapter for the tiny llama, built with numpy: r=4, alpha=8,
    q_proj / v_proj of both blocks. Different seeds give different weights."""
    import numpy as np
    from safetensors.numpy import save

    rng = np.random.default_rng(version_seed)
    hidden, kv = IDENTITY["hidden_size"], 32  # 2 kv heads of head_dim 16
    tensors = {}
    for layer in range(IDENTITY["num_layers"]):
        for module, out in (("q_proj", hidden), ("v_proj", kv)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((4, hidden)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((out, 4)).astype(np.float32)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8,
              "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0, "bias": "none",
              "use_rslora": False, "use_dora": False, "base_model_name_or_path": "tiny"}
    return {"adapter_config.json": json.dumps(config).encode(),
            "adapter_model.safetensors": save(tensors)}
