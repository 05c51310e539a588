"""The one server interceptor of every gridrl gRPC server: the caller's credential and scope,
the request bytes, the domain error turned into a gRPC status, and the RPC metrics.

This is the one place a :class:`gridrl.common.errors.StatusError` becomes a gRPC status
(:func:`grpc_status`): handlers and the domain code below them raise it and never touch the
servicer context.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from gridrl.common.errors import Kind, StatusError, invalid_argument
from gridrl.common.rpc.metrics import RPC_DURATION, RPC_REQUESTS, split_method
from gridrl.common.security.access import (
    Decision,
    authorize,
    calling_as,
    check_bound_certificate,
)
from gridrl.common.security.tokens import AuthorizedTokens

log = logging.getLogger(__name__)


def grpc_status(kind: Kind) -> grpc.StatusCode:
    """The gRPC status code of a domain error's kind (the same canonical code)."""
    return grpc.StatusCode[kind.name]


class ServerInterceptor(grpc.ServerInterceptor):
    """Checks the caller's credential and scope (:func:`gridrl.common.security.access.authorize`) and,
    for a credential bound to a client certificate, the certificate the connection presented;
    makes it :func:`gridrl.common.security.access.caller` inside the handler, turns :class:`StatusError` into a
    status, and records ``gridrl_rpc_requests_total`` / ``gridrl_rpc_duration_seconds``."""

    def __init__(self, tokens: AuthorizedTokens | None) -> None:
        self._tokens = tokens

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        service, name = split_method(method)
        decision = authorize(self._tokens, method, handler_call_details.invocation_metadata)

        def finish(context: grpc.ServicerContext, start: float, code: grpc.StatusCode | None) -> None:
            code = code or context.code() or grpc.StatusCode.OK
            if isinstance(code, int):  # some grpcio versions report the raw enum value
                code = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
            RPC_REQUESTS.labels(service, name, code.name).inc()
            RPC_DURATION.labels(service, name).observe(time.perf_counter() - start)

        def unary_response(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(request_or_iterator: Any, context: grpc.ServicerContext) -> Any:
                start = time.perf_counter()
                checked = _peer_checked(decision, method, context)
                if checked.code is not None:
                    finish(context, start, grpc_status(checked.code))
                    context.abort(grpc_status(checked.code), checked.message)
                try:
                    with calling_as(checked.credential):
                        response = behavior(request_or_iterator, context)
                except StatusError as e:
                    finish(context, start, grpc_status(e.kind))
                    context.abort(grpc_status(e.kind), e.message)
                except Exception:
                    code = _ended_code(context)
                    finish(context, start, code or grpc.StatusCode.UNKNOWN)
                    if code is None:
                        log.exception("unhandled error in %s", method)
                    raise
                finish(context, start, None)
                return response

            return wrapped

        def stream_response(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(request_or_iterator: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                start = time.perf_counter()
                checked = _peer_checked(decision, method, context)
                if checked.code is not None:
                    finish(context, start, grpc_status(checked.code))
                    context.abort(grpc_status(checked.code), checked.message)
                try:
                    with calling_as(checked.credential):
                        yield from behavior(request_or_iterator, context)
                except StatusError as e:
                    finish(context, start, grpc_status(e.kind))
                    context.abort(grpc_status(e.kind), e.message)
                except GeneratorExit:  # client went away
                    finish(context, start, grpc.StatusCode.CANCELLED)
                    raise
                except Exception:
                    code = _ended_code(context)
                    finish(context, start, code or grpc.StatusCode.UNKNOWN)
                    if code is None:
                        log.exception("unhandled error in %s", method)
                    raise
                finish(context, start, None)

            return wrapped

        # Requests whose bytes do not parse reach the handler as _Undecodable and are answered
        # INVALID_ARGUMENT (grpc's own answer would be INTERNAL "Exception deserializing
        # request!").
        parse = _lenient(handler.request_deserializer)
        serialize = _preserialized(handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                unary_response(_decoded_request(handler.unary_unary)), parse,
                serialize)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                unary_response(_decoded_stream(handler.stream_unary)), parse,
                serialize)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                stream_response(_decoded_request(handler.unary_stream)), parse,
                serialize)
        return grpc.stream_stream_rpc_method_handler(
            stream_response(_decoded_stream(handler.stream_stream)), parse,
            serialize)


def _ended_code(context: grpc.ServicerContext) -> grpc.StatusCode | None:
    """The status of a call a handler left by an exception: the one it set, CANCELLED when the
    client is gone (reading a cancelled client's request stream raises), else None (a bug)."""
    code = context.code()
    if code is None and not context.is_active():
        return grpc.StatusCode.CANCELLED
    return code


def _peer_checked(decision: Decision, method: str, context: grpc.ServicerContext) -> Decision:
    """``decision`` with a certificate-bound credential checked against the client's
    certificate (:func:`gridrl.common.security.access.check_bound_certificate`)."""
    if decision.credential is None or decision.credential.cert is None:
        return decision
    pem = (context.auth_context() or {}).get("x509_pem_cert") or [None]
    return check_bound_certificate(decision, method, pem[0])


def _preserialized(serializer: Callable[[Any], bytes] | None
                   ) -> Callable[[Any], bytes] | None:
    """``serializer``, except that a response a handler yields already serialized (``bytes``:
    ReadAdapter's pieces, ``gridrl.common.transport.encode_read_response``) goes out as it
    is, without protobuf copying it again."""
    if serializer is None:
        return None

    def serialize(response: Any) -> bytes:
        return response if isinstance(response, bytes) else serializer(response)

    return serialize


class _Undecodable:
    """A request message whose bytes did not parse, with the parser's complaint."""

    def __init__(self, type_name: str, error: Exception) -> None:
        self.type_name = type_name
        self.error = error

    def status(self, field: str) -> StatusError:
        """INVALID_ARGUMENT ``<field>: the bytes are not a <type> message (<error>)``."""
        return invalid_argument(field, f"the bytes are not a {self.type_name} message "
                                       f"({self.error})")


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``deserializer`` returning :class:`_Undecodable` instead of raising."""
    if deserializer is None:
        return None
    message_type = getattr(deserializer, "__self__", None)
    type_name = getattr(getattr(message_type, "DESCRIPTOR", None), "full_name", "request")

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as e:  # protobuf's DecodeError, or any parser's error
            return _Undecodable(type_name, e)

    return parse


def _decoded_request(behavior: Callable[..., Any]) -> Callable[..., Any]:
    """``behavior`` for a unary request: INVALID_ARGUMENT ``request: ...`` when it did not
    parse."""
    def call(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            raise request.status("request")
        return behavior(request, context)

    return call


def _decoded_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
    """``behavior`` for a request stream: reading a message that did not parse raises
    INVALID_ARGUMENT ``request[<index in the stream>]: ...`` inside the handler."""
    def messages(requests: Iterator[Any]) -> Iterator[Any]:
        for i, request in enumerate(requests):
            if isinstance(request, _Undecodable):
                raise request.status(f"request[{i}]")
            yield request

    def call(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        return behavior(messages(requests), context)

    return call

