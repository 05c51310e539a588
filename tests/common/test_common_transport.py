"""The PushAdapter stream format: both ends, every refusal."""

from __future__ import annotations

import hashlib

import pytest

from gridrl.adapters import AdapterManifest
from gridrl.common.errors import Kind, StatusError
from gridrl.common.transport import push_requests, receive_push
from gridrl.v1 import common_pb2, rollout_pb2

FILES = {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": bytes(range(256)) * 40}


def manifest_to_proto(d: dict) -> common_pb2.AdapterManifest:
    return AdapterManifest.from_dict(d).to_proto()


def manifest(files=FILES, **over):
    d = {"name": "run-1", "version": 3, "format": "peft",
         "base_model": {"model_id": "m", "architecture": "llama", "hidden_size": 64,
                        "num_layers": 2, "vocab_size": 512, "weights_fingerprint": "wfp1:0f"},
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
    assert AdapterManifest.from_proto(got.manifest).to_dict() == manifest()
    assert manifest_to_proto(manifest()).format == common_pb2.ADAPTER_FORMAT_PEFT


def _code(reqs, max_bytes=1 << 20):
    with pytest.raises(StatusError) as e:
        receive_push(reqs, max_bytes=max_bytes)
    return e.value.kind, e.value.message


def test_refusals() -> None:
    good = list(push_requests(manifest(), FILES, chunk_size=4096))
    code, msg = _code(good[1:])
    assert code is Kind.INVALID_ARGUMENT and msg.startswith("header:")
    code, msg = _code(good[:-1])  # truncated
    assert code is Kind.DATA_LOSS and "truncated" in msg
    bad = list(good)
    bad[-1] = rollout_pb2.PushAdapterRequest(chunk=rollout_pb2.AdapterChunk(
        path=bad[-1].chunk.path, offset=bad[-1].chunk.offset,
        data=b"\0" * len(bad[-1].chunk.data)))
    code, msg = _code(bad)
    assert code is Kind.DATA_LOSS and "sha256" in msg
    code, msg = _code(good, max_bytes=100)
    assert code is Kind.RESOURCE_EXHAUSTED and msg.startswith("header.manifest.files")
    code, msg = _code(list(push_requests(manifest(version=0), FILES)))
    assert code is Kind.INVALID_ARGUMENT and msg.startswith("header.manifest.version")
    m = manifest()
    m["files"][0]["path"] = "../etc/passwd"
    code, msg = _code([rollout_pb2.PushAdapterRequest(header=rollout_pb2.PushAdapterHeader(
        manifest=manifest_to_proto(m)))])
    assert code is Kind.INVALID_ARGUMENT and msg.startswith("header.manifest.files[0].path")
    code, msg = _code([good[0], good[2], good[1]])  # out of order
    assert code is Kind.INVALID_ARGUMENT and msg.startswith("chunk.")


@pytest.mark.parametrize("name", ["", "..", ".x", "-x", "a/b", "a b", "r\u00e9sum\u00e9",
                                  "x" * 129])
def test_adapter_names_that_cannot_name_a_store_directory_are_refused(name) -> None:
    """The adapter name becomes a directory in the node's store: ASCII letters, digits and
    ``._-``, starting with a letter or digit, at most 128 characters (the trainer's
    ``--run-name`` follows the same rule)."""
    code, msg = _code([rollout_pb2.PushAdapterRequest(header=rollout_pb2.PushAdapterHeader(
        manifest=manifest_to_proto(manifest(name=name))))])
    assert code is Kind.INVALID_ARGUMENT
    assert msg.startswith("header.manifest.name") and "1-128 characters" in msg


def test_the_longest_adapter_name_is_accepted() -> None:
    got = receive_push(list(push_requests(manifest(name="r" * 128), FILES)), max_bytes=1 << 20)
    assert got.manifest.name == "r" * 128


def _undigested(files=FILES):
    m = manifest(files)
    for f in m["files"]:
        f["sha256"] = ""
    return m


def test_digests_in_the_trailer() -> None:
    """A manifest without digests: the sender hashes while streaming and ends with a trailer;
    the receiver checks it and returns the manifest with the digests filled in."""
    reqs = list(push_requests(_undigested(), FILES, chunk_size=1000))
    assert [r.WhichOneof("payload") for r in (reqs[0], reqs[-1])] == ["header", "trailer"]
    assert len(reqs) == 1 + 1 + 11 + 1
    assert list(reqs[-1].trailer.file_sha256) == [hashlib.sha256(FILES[p]).hexdigest()
                                                  for p in sorted(FILES)]
    got = receive_push(reqs, max_bytes=1 << 20)
    assert got.files == FILES
    assert AdapterManifest.from_proto(got.manifest).to_dict() == manifest()  # digests from the trailer
    # a manifest with digests sends no trailer
    assert all(r.WhichOneof("payload") != "trailer" for r in push_requests(manifest(), FILES))


def test_trailer_refusals() -> None:
    good = list(push_requests(_undigested(), FILES, chunk_size=4096))
    header, chunks, trailer = good[0], good[1:-1], good[-1]
    code, msg = _code([header, *chunks])  # every byte, no trailer
    assert code is Kind.INVALID_ARGUMENT and msg.startswith("trailer: missing")
    code, msg = _code([header, *chunks[:-1]])  # truncated: the size check comes first
    assert code is Kind.DATA_LOSS and "truncated" in msg
    code, msg = _code([header, *chunks[:-1], trailer, chunks[-1]])
    assert code is Kind.INVALID_ARGUMENT and msg.startswith("trailer: must be the last")
    code, msg = _code([header, *chunks, trailer, trailer])
    assert code is Kind.INVALID_ARGUMENT and msg.startswith("trailer: must be the last")
    wrong = rollout_pb2.PushAdapterRequest(trailer=rollout_pb2.PushAdapterTrailer(
        file_sha256=[trailer.trailer.file_sha256[0], "0" * 64]))
    code, msg = _code([header, *chunks, wrong])
    assert code is Kind.DATA_LOSS and "does not match the trailer's" in msg
    short = rollout_pb2.PushAdapterRequest(trailer=rollout_pb2.PushAdapterTrailer(
        file_sha256=[trailer.trailer.file_sha256[0]]))
    code, msg = _code([header, *chunks, short])
    assert code is Kind.INVALID_ARGUMENT and msg.startswith("trailer.file_sha256:")
    upper = rollout_pb2.PushAdapterRequest(trailer=rollout_pb2.PushAdapterTrailer(
        file_sha256=[d.upper() for d in trailer.trailer.file_sha256]))
    code, msg = _code([header, *chunks, upper])
    assert code is Kind.INVALID_ARGUMENT and msg.startswith("trailer.file_sha256[0]")
    # a header with digests takes no trailer
    with_digests = list(push_requests(manifest(), FILES, chunk_size=4096))
    code, msg = _code([*with_digests, trailer])
    assert code is Kind.INVALID_ARGUMENT and msg.startswith("trailer: unexpected")
    # some digests but not all: refused by both ends
    mixed = manifest()
    mixed["files"][1]["sha256"] = ""
    with pytest.raises(ValueError, match="every file or of none"):
        list(push_requests(mixed, FILES))
    code, msg = _code([rollout_pb2.PushAdapterRequest(header=rollout_pb2.PushAdapterHeader(
        manifest=manifest_to_proto(mixed)))])
    assert code is Kind.INVALID_ARGUMENT and msg.startswith(
        "header.manifest.files[1].sha256")


def test_enum_words_come_from_the_enums_own_names() -> None:
    """One helper turns every gridrl.v1 enum value into the word gridrl uses and back."""
    from gridrl.v1 import common_pb2, runs_pb2, trainer_pb2
    from gridrl.v1.enums import enum_value, enum_word

    for enum in (common_pb2.Backend, common_pb2.AdapterFormat, common_pb2.FinishReason,
                 common_pb2.NodeRole, common_pb2.NodeStatus, trainer_pb2.RunState,
                 runs_pb2.RunEventKind):
        for value in enum.values():  # each a lower-case word that leads back to it
            word = enum_word(enum, value)
            assert word == word.lower() and (word == "") == (value == 0)
            assert enum.Name(value).lower().endswith(word) and enum_value(enum, word) == value
    assert enum_word(common_pb2.Backend, common_pb2.BACKEND_TORCH) == "torch"
    assert enum_word(trainer_pb2.RunState, trainer_pb2.RUN_STATE_RUNNING) == "running"
    assert enum_word(runs_pb2.RunEventKind, runs_pb2.RUN_EVENT_KIND_NODE_JOINED) == "node_joined"
    # the unspecified value and one from a newer peer: the default, or spelled out (None)
    assert (enum_word(common_pb2.Backend, 0), enum_word(common_pb2.Backend, 99)) == ("", "")
    assert enum_word(common_pb2.AdapterFormat, 99, "peft") == "peft"
    assert (enum_word(common_pb2.NodeRole, 0, None), enum_word(common_pb2.NodeRole, 99, None)) \
        == ("unspecified", "99")
    assert enum_value(common_pb2.AdapterFormat, "") == 0
    assert enum_value(common_pb2.AdapterFormat, "onnx", default=0) == 0
    for word in ("onnx", "unspecified"):
        with pytest.raises(ValueError, match=rf"^'{word}' is not a AdapterFormat \(one of peft"):
            enum_value(common_pb2.AdapterFormat, word)
