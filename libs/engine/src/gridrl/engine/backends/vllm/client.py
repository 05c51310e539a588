"""HTTP to one vLLM server: a private asyncio loop thread running httpx, and vLLM's runtime
LoRA routes (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``) with what their refusals
mean.

:class:`~gridrl.engine.backends.vllm.backend.VllmBackend` talks to vLLM only through a
:class:`VllmClient`; what the requests and answers hold is :mod:`.wire`'s.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from gridrl.engine.backends.vllm.wire import HttpAnswer, VllmError, VllmRefused, VllmUnavailable
from gridrl.engine.contract import AdapterLoadError, DecodeInterrupted

if logging.getLogger("httpx").level == logging.NOTSET:  # not a line per request at INFO
    logging.getLogger("httpx").setLevel(logging.WARNING)
T = TypeVar("T")

_POLL_S = 0.02  # how often a running batch checks its observer


class LoopThread:
    """An asyncio loop on a daemon thread, running a backend's HTTP coroutines."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-http",
                                       daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable[T], observer: Any = None) -> T:
        """Run ``coro`` on the loop and return its result; with an ``observer`` whose
        ``interrupted()`` turns true, cancel it (closing its connections, which makes vLLM
        abort the requests), wait until it has unwound and raise :class:`DecodeInterrupted`."""
        finished = threading.Event()

        async def start() -> asyncio.Task:
            task = asyncio.ensure_future(coro)
            task.add_done_callback(lambda _: finished.set())  # also when cancelled unstarted
            return task

        task = asyncio.run_coroutine_threadsafe(start(), self.loop).result()
        interrupted = observer.interrupted if observer is not None else None
        while not finished.wait(None if interrupted is None else _POLL_S):
            if interrupted is not None and interrupted():
                self.loop.call_soon_threadsafe(task.cancel)
                finished.wait(30)
                raise DecodeInterrupted(0, "its vLLM requests were cancelled")
        return task.result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class VllmClient:
    """An httpx client of the vLLM server at ``url``, on its own :class:`LoopThread`.

    Args:
        url: vLLM's base URL, without a trailing slash.
        api_key: one of vLLM's ``--api-key`` values (None: none sent).
        max_concurrency: most HTTP requests in flight.
        request_timeout_s: seconds one request may take.
        on_unreachable: called when a request cannot reach vLLM (before
            :class:`VllmUnavailable` is raised).
    """

    def __init__(self, url: str, *, api_key: str | None, max_concurrency: int,
                 request_timeout_s: float, on_unreachable: Callable[[], None]) -> None:
        import httpx

        self.url = url
        self._on_unreachable = on_unreachable
        self._loop = LoopThread()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_concurrency,
                              max_keepalive_connections=max_concurrency)
        timeout = httpx.Timeout(request_timeout_s, connect=10.0)

        async def make() -> httpx.AsyncClient:
            return httpx.AsyncClient(base_url=self.url, headers=headers, limits=limits,
                                     timeout=timeout)

        self._client = self._loop.run(make())

    def run(self, coro: Awaitable[T], observer: Any = None) -> T:
        """:meth:`LoopThread.run` on this client's loop."""
        return self._loop.run(coro, observer)

    def close(self) -> None:
        """Close the HTTP client and its loop."""
        try:
            self._loop.run(self._client.aclose())
        finally:
            self._loop.close()

    async def request(self, method: str, path: str, body: Any = None) -> HttpAnswer:
        """One request (``body`` sent as JSON), on the loop.

        Raises:
            VllmUnavailable: vLLM cannot be reached.
        """
        import httpx

        try:
            r = await self._client.request(method, path, json=body)
        except httpx.TransportError as e:
            self._on_unreachable()
            raise VllmUnavailable(f"vLLM at {self.url} unreachable ({method} {path}): "
                                  f"{type(e).__name__}: {e}") from e
        try:
            parsed = r.json()
        except ValueError:
            parsed = None
        return HttpAnswer(r.status_code, parsed, r.text)

    def call(self, method: str, path: str, body: Any = None) -> HttpAnswer:
        """:meth:`request` from the calling thread, waiting for the answer."""
        return self._loop.run(self.request(method, path, body))

    def unauthorized(self, answer: HttpAnswer) -> VllmRefused:
        """The error for a 401 answer: the API key was refused."""
        return VllmRefused(f"vLLM at {self.url} refused the API key (401 {answer.message}): "
                           "give one of its --api-key values with --vllm-api-key-file")

    def load_lora(self, name: str, path: Path) -> None:
        """POST load_lora_adapter. Raises AdapterLoadError (with the flag to add when the
        answer says which), VllmRefused on 401, VllmUnavailable."""
        answer = self.call("POST", "/v1/load_lora_adapter",
                           {"lora_name": name, "lora_path": str(path), "load_inplace": False})
        if answer.status == 200:
            return
        if answer.status == 401:
            raise self.unauthorized(answer)
        raise AdapterLoadError(f"vLLM refused to load {name} ({answer.status}: "
                               f"{answer.message}){self._lora_hint(answer, path)}")

    @staticmethod
    def _lora_hint(answer: HttpAnswer, path: Path) -> str:
        msg = answer.message
        if answer.route_missing:
            return ("; vLLM has no runtime LoRA routes: start it with "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment")
        if "LoRA is not enabled" in msg:
            return "; start vLLM with --enable-lora"
        if "max_lora_rank" in msg:
            return "; start vLLM with a larger --max-lora-rank"
        if "No adapter found" in msg:
            return (f"; vLLM cannot read {path}: it must run on this machine and see the "
                    "node's --adapter-root")
        return ""

    def unload_lora(self, name: str) -> None:
        """POST unload_lora_adapter. Raises VllmRefused on 401, VllmError on another refusal,
        VllmUnavailable."""
        answer = self.call("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        if answer.status == 401:
            raise self.unauthorized(answer)
        if answer.status != 200:
            raise VllmError(f"unload of {name} answered {answer.status}: {answer.message}")
