"""The PushAdapter stream format: both ends, every refusal."""

from __future__ import annotations

import hashlib

import grpc
import pytest

from gridrl.common.errors import StatusError
from gridrl.common.transport import (
    manifest_to_dict,
    manifest_to_proto,
    push_requests,
    receive_push,
)
from gridrl.v1 import common_pb2, rollout_pb2

FILES = {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": bytes(range(256)) * 40}


def manifest(files=FILES, **over):
    d = {"name": "run-1", "version": 3, "format": "peft",
         "base_model": {"model_id": "m", "architecture": "llama", "hidden_size": 64,
                        "num_layers": 2, "vocab_size": 512},
         "rank": 4, "scale": 2.0, "target_modules": ["self_attn.q_proj"], "layers": [0, 1],
         "files": [{"path": p, "size_bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
                   for p, b in sorted(files.items())]}
    d.update(over)
    return d


def test_round_trip_small_chunks() -> None:
    reqs = list(push_requests(manifest(), FILES, chunk_size=1000))
    assert reqs[0].WhichOneof("payload") == "header"
    assert len(reqs) == 1 + 1 + 11  # header, config (1 chunk), 10240 bytes in 1000-byte chunks
    got = receive_push(reqs, max_bytes=1 << 20)
    assert got.files == FILES
    assert got.bytes_received == sum(map(len, FILES.values()))
    assert manifest_to_dict(got.manifest) == manifest()
    assert manifest_to_proto(manifest()).format == common_pb2.ADAPTER_FORMAT_PEFT


def _code(reqs, max_bytes=1 << 20):
    with pytest.raises(StatusError) as e:
        receive_push(reqs, max_bytes=max_bytes)
    return e.value.code, e.value.message


def test_refusals() -> None:
    good = list(push_requests(manifest(), FILES, chunk_size=4096))
    code, msg = _code(good[1:])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("header:")
    code, msg = _code(good[:-1])  # truncated
    assert code == grpc.StatusCode.DATA_LOSS and "truncated" in msg
    bad = list(good)
    bad[-1] = rollout_pb2.PushAdapterRequest(chunk=rollout_pb2.AdapterChunk(
        path=bad[-1].chunk.path, offset=bad[-1].chunk.offset,
        data=b"\0" * len(bad[-1].chunk.data)))
    code, msg = _code(bad)
    assert code == grpc.StatusCode.DATA_LOSS and "sha256" in msg
    code, msg = _code(good, max_bytes=100)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and msg.startswith("header.manifest.files")
    code, msg = _code(list(push_requests(manifest(version=0), FILES)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("header.manifest.version")
    m = manifest()
    m["files"][0]["path"] = "../etc/passwd"
    code, msg = _code([rollout_pb2.PushAdapterRequest(header=rollout_pb2.PushAdapterHeader(
        manifest=manifest_to_proto(m)))])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("header.manifest.files[0].path")
    code, msg = _code([good[0], good[2], good[1]])  # out of order
    assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("chunk.")
