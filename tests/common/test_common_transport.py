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


# -- relay fan-out: the plan and the ReadAdapter wire --------------------------------------------


@pytest.mark.parametrize("piece_bytes", [1, 7, 8, 9, 1000, 4096, 10248, 1 << 20])
def test_relay_plan_hashes_pieces_across_file_boundaries(piece_bytes: int) -> None:
    from gridrl.common.transport import relay_plan

    m = manifest_to_proto(manifest())
    blob = b"".join(FILES[f.path] for f in m.files)  # 8 + 10240 bytes, in manifest order
    plan = relay_plan(m, FILES, ["10.0.0.2:50051"], piece_bytes=piece_bytes)
    assert list(plan.piece_sha256) == [hashlib.sha256(blob[i:i + piece_bytes]).hexdigest()
                                       for i in range(0, len(blob), piece_bytes)]
    assert plan.piece_bytes == piece_bytes and list(plan.readers) == ["10.0.0.2:50051"]


@pytest.mark.parametrize("offset", [0, 1, 127, 128, 300, 1 << 35, (1 << 64) - 1])
@pytest.mark.parametrize("size", [0, 1, 127, 128, 70000])
def test_read_responses_are_what_protobuf_writes_and_reads(offset: int, size: int) -> None:
    from gridrl.common.transport import decode_read_response, encode_read_response

    data = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    wire = rollout_pb2.ReadAdapterResponse(offset=offset, data=data).SerializeToString()
    assert encode_read_response(offset, memoryview(data)) == wire
    got = decode_read_response(wire)
    assert (got.offset, bytes(got.data)) == (offset, data)
    parsed = rollout_pb2.ReadAdapterResponse.FromString(encode_read_response(offset, data))
    assert (parsed.offset, parsed.data) == (offset, data)


def test_read_responses_in_any_valid_encoding_decode_like_protobuf() -> None:
    from gridrl.common.transport import decode_read_response

    data_field = rollout_pb2.ReadAdapterResponse(data=b"piece").SerializeToString()
    offset_field = rollout_pb2.ReadAdapterResponse(offset=4096).SerializeToString()
    unknown = (b"\x18\x05"  # field 3, varint
               + b"\x22\x02ab"  # field 4, bytes
               + b"\x29" + bytes(8)  # field 5, 64-bit
               + b"\x35" + bytes(4))  # field 6, 32-bit
    old = rollout_pb2.ReadAdapterResponse(offset=1, data=b"old").SerializeToString()
    for wire in (data_field + offset_field, unknown + offset_field + data_field,
                 old + offset_field + data_field):  # reversed, unknown fields, repeated
        want = rollout_pb2.ReadAdapterResponse.FromString(wire)
        got = decode_read_response(wire)
        assert (got.offset, bytes(got.data)) == (want.offset, want.data) == (4096, b"piece")
    empty = decode_read_response(b"")
    assert (empty.offset, bytes(empty.data)) == (0, b"")


@pytest.mark.parametrize("wire", [
    b"\x08",  # a varint cut short
    b"\x08" + b"\xff" * 10 + b"\x01",  # a varint of more than 64 bits
    b"\x12\x05abc",  # data longer than the message
    b"\x10\x05",  # data as a varint
    b"\x0a\x01a",  # offset length-delimited
    b"\x1b",  # a group (field 3, start group)
    b"\x29\x00",  # a 64-bit field cut short
])
def test_malformed_read_responses_are_refused(wire: bytes) -> None:
    from gridrl.common.transport import decode_read_response

    with pytest.raises(ValueError, match="ReadAdapterResponse"):
        decode_read_response(wire)
