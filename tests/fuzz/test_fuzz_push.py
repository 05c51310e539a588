"""Hypothesis over the rollout node's PushAdapter client stream: reordered, duplicated,
dropped, oversized, shrunk and flipped chunks; manifests and trailers that lie; headers made
wrong; streams cut short; clients that cancel mid-stream. A refused push changes nothing on
disk or in what serves; an accepted one serves and is stored whole (``fuzzkit`` docstring)."""

from __future__ import annotations

import fuzzkit
import grpc
from fuzzkit import Cluster, PushCase
from hypothesis import given, settings

from gridrl.v1 import rollout_pb2


@settings(max_examples=120)
@given(case=fuzzkit.push_cases())
def test_push_stream(cluster: Cluster, case: PushCase) -> None:
    fuzzkit.push_case(cluster, case)


def test_the_node_takes_a_valid_push_after_the_fuzz(cluster: Cluster) -> None:
    """After the cases: nothing holds the store, a valid push of a new version serves and a
    Generate reports it."""
    version = 1 + max(r.version for r in cluster.node.info().stored_adapters)
    response = cluster.rollout.PushAdapter(iter(cluster.push_requests(
        version, 1 << 16, trailer=True)), timeout=fuzzkit.DEADLINE_S)
    assert (response.serving.name, response.serving.version) == ("fuzz", version)
    out = cluster.rollout.Generate(rollout_pb2.GenerateRequest(
        prompt_token_ids=[5, 7, 9], sampling={"max_tokens": 2}), timeout=fuzzkit.DEADLINE_S)
    assert out.samples[0].adapter_version == version


def test_cancelled_mid_stream_changes_nothing(cluster: Cluster) -> None:
    """A client that goes away after the header and one chunk: nothing stored, the same
    adapter serves, and the next push is not blocked."""
    requests = cluster.push_requests(90, 4096, trailer=True)
    answer = cluster.push(requests, cut_after=2)
    assert answer.code == grpc.StatusCode.CANCELLED
    assert cluster.push(cluster.push_requests(91, 4096, trailer=True)).code == grpc.StatusCode.OK
