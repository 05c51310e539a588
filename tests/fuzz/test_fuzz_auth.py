"""Hypothesis over the ``authorization`` metadata of calls to a master that accepts only its
own credentials: OK for a token whose scope covers the RPC, else UNAUTHENTICATED or
PERMISSION_DENIED naming the RPC, never anything else."""

from __future__ import annotations

from collections.abc import Iterator

import fuzzkit
import grpc
import pytest
from fuzzkit import SecuredMaster
from hypothesis import given, settings


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredMaster]:
    m = SecuredMaster(tmp_path_factory.mktemp("auth"))
    yield m
    m.close()


@pytest.mark.parametrize("rpc", ["ListNodes", "RegisterNode"])
def test_authorization_metadata(secured: SecuredMaster, rpc: str) -> None:
    @settings(max_examples=30)
    @given(header=fuzzkit.auth_headers(secured.tokens))
    def case(header: str | None) -> None:
        answer = fuzzkit.call_with_auth(secured, rpc, header)
        fuzzkit.check_auth_answer(answer, rpc)
        scope = "read" if rpc == "ListNodes" else "node"
        if header in (f"Bearer {secured.tokens[scope]}", f"bearer  {secured.tokens[scope]} "):
            assert answer.code == grpc.StatusCode.OK, answer

    case()
