"""A stand-in for ``vllm serve MODEL`` on a tiny model, for the vllm backend's tests (imported as
``vllm_standin``). No vLLM runs on these machines; this server answers real HTTP with the shapes
of vLLM 0.33.0's OpenAI routes (see ``gridrl.engine.backends.vllm.backend`` for the file and line
ranges it follows) and samples honestly:

- the model is the tiny llama (transformers), LoRA adapters are loaded by peft from the path
  given to ``/v1/load_lora_adapter``, read from disk like vLLM does;
- each completion step runs vLLM's sampler (``v1/sample/sampler.py`` ``Sampler.sample``): greedy
  below temperature 1e-5, else logits / T, top-k by the k-th value, top-p by vLLM's ascending
  cumulative mask (``topk_topp_sampler.py`` ``apply_top_k_top_p_pytorch``), and a draw with
  exponential noise from a generator seeded with the request seed (``random_sample``);
- logprobs are ``processed_logprobs`` (log-softmax of what was sampled from) or, in
  ``raw_logprobs`` mode (vLLM's default), the log-softmax of the logits; -inf is written -9999.

Modes and faults: ``api_key`` (401 ``{"error": "Unauthorized"}`` on /v1 without it),
``enable_lora`` (loads answer 500 "LoRA is not enabled" without it), ``runtime_lora`` (the
load/unload routes exist only with it, else FastAPI's 404), ``max_lora_rank``,
``honour_token_ids=False`` (a server that detokenizes token-id prompts and tokenizes the text
again), ``disk`` (a server on another machine or in a container: it sees only files under that
directory), ``mutate`` (rewrites completion bodies: plain-text tokens, misaligned lists...),
``step_delay`` (seconds per token; a client that disconnects aborts its request, counted in
``aborted``), :meth:`StandInVllm.restart` (forgets every LoRA, like a restarted vLLM).
``violations`` records a LoRA load that arrived while completions were running.
"""

from __future__ import annotations

import json
import math
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

GUARDED = ("/v1", "/v2", "/inference", "/cohere")
SAMPLING_EPS = 1e-5
MAX_TEMP = 1e-2


def _error(status: int, message: str, err_type: str, param: str | None = None) -> tuple:
    return status, {"error": {"message": message, "type": err_type, "param": param,
                              "code": status}}


class StandInVllm:
    """A vLLM-shaped HTTP server on ``127.0.0.1:port`` (0: any free port) over the model in
    ``model_dir``.

    Attributes:
        url: ``http://127.0.0.1:PORT`` once started.
        loras: served LoRA name -> its path.
        completions: completion requests answered (bodies as received).
        aborted: completions whose client disconnected before the end.
        violations: LoRA loads that arrived while completions ran.
    """

    def __init__(self, model_dir: Path, *, logprobs_mode: str = "processed_logprobs",
                 enable_lora: bool = True, runtime_lora: bool = True, api_key: str | None = None,
                 max_lora_rank: int = 16, max_model_len: int | None = None,
                 honour_token_ids: bool = True, served_name: str | None = None,
                 port: int = 0, disk: Path | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
        self.peft: Any = None
        self.torch = torch
        self.logprobs_mode = logprobs_mode
        self.enable_lora = enable_lora
        self.runtime_lora = runtime_lora
        self.api_key = api_key
        self.max_lora_rank = max_lora_rank
        self.max_model_len = max_model_len or self.model.config.max_position_embeddings
        self.honour_token_ids = honour_token_ids
        self.disk = disk  # None: sees this machine's files; else only those under it
        self.served_name = served_name or str(model_dir)
        self.mutate: Callable[[dict], dict] | None = None
        self.step_delay = 0.0
        self.loras: dict[str, str] = {}
        self._peft_keys: dict[str, str] = {}  # served name -> peft adapter name
        self.completions: list[dict] = []
        self.loads: list[str] = []
        self.aborted = 0
        self.violations: list[str] = []
        self._in_flight = 0
        self._lock = threading.Lock()  # state
        self._model_lock = threading.Lock()  # one forward at a time
        self._server: ThreadingHTTPServer | None = None
        self._connections: set[socket.socket] = set()
        self.port = port
        self.url = ""

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> StandInVllm:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with standin._lock:
                    standin._connections.add(self.connection)

            def finish(self) -> None:
                with standin._lock:
                    standin._connections.discard(self.connection)
                super().finish()

            def do_GET(self) -> None:
                standin._handle(self, "GET")

            def do_POST(self) -> None:
                standin._handle(self, "POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop listening and drop every open connection (a process that went away)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        with self._lock:
            for conn in self._connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def restart(self) -> None:
        """Forget every LoRA name (a vLLM restart; the weights stay, as the base is the same)."""
        with self._lock:
            self.loras.clear()
            self._peft_keys.clear()

    # -- HTTP --------------------------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        body: Any = None
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        path = h.path.split("?")[0]
        if self.api_key and path.startswith(GUARDED) and \
                h.headers.get("Authorization") != f"Bearer {self.api_key}":
            return self._send(h, 401, {"error": "Unauthorized"})
        if method == "POST":
            if h.headers.get("Content-Type", "").split(";")[0] != "application/json":
                return self._send(h, *_error(400, "Unsupported Media Type: Only "
                                             "'application/json' is allowed", "Bad Request"))
            try:
                body = json.loads(raw)
            except ValueError:
                return self._send(h, *_error(400, "JSON decode error", "Bad Request"))
        routes: dict[tuple[str, str], Callable[..., Any]] = {
            ("GET", "/v1/models"): self._models, ("GET", "/version"): self._version,
            ("GET", "/health"): lambda _b: (200, ""),
            ("POST", "/tokenize"): self._tokenize,
            ("POST", "/v1/completions"): lambda b: self._completions(b, h),
        }
        if self.runtime_lora:
            routes[("POST", "/v1/load_lora_adapter")] = self._load
            routes[("POST", "/v1/unload_lora_adapter")] = self._unload
        route = routes.get((method, path))
        if route is None:
            return self._send(h, 404, {"detail": "Not Found"})
        result = route(body)
        if result is not None:
            self._send(h, *result)

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, body: Any) -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        try:
            h.send_response(status)
            h.send_header("Content-Type", "text/plain" if isinstance(body, str)
                          else "application/json")
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data)
        except OSError:
            h.close_connection = True

    # -- routes ------------------------------------------------------------------------------

    def _version(self, _body: Any) -> tuple:
        return 200, {"version": "0.33.0"}

    def _models(self, _body: Any) -> tuple:
        with self._lock:
            cards = [{"id": self.served_name, "object": "model", "owned_by": "vllm",
                      "root": str(self.model_dir), "parent": None,
                      "max_model_len": self.max_model_len}]
            cards += [{"id": name, "object": "model", "owned_by": "vllm", "root": path,
                       "parent": self.served_name, "max_model_len": None}
                      for name, path in self.loras.items()]
        return 200, {"object": "list", "data": cards}

    def _tokenize(self, body: dict) -> tuple:
        ids = self.tokenizer(body["prompt"],
                             add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
        return 200, {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    def _load(self, body: dict) -> tuple:
        name, path = body.get("lora_name"), body.get("lora_path")
        with self._lock:
            if self._in_flight:
                self.violations.append(f"load of {name} while {self._in_flight} completions "
                                       "ran")
            if not name or not path:
                return _error(400, "Both 'lora_name' and 'lora_path' must be provided.",
                              "InvalidUserInput")
            if name == self.served_name:
                return _error(400, f"The lora adapter '{name}' conflicts with a served base "
                              "model.", "InvalidUserInput")
            if not body.get("load_inplace") and name in self.loras:
                return _error(400, f"The lora adapter '{name}' has already been loaded. If you "
                              "want to load the adapter in place, set 'load_inplace' to True.",
                              "InvalidUserInput")
        if not self.enable_lora:
            return _error(500, "LoRA is not enabled. Use --enable-lora to enable LoRA.",
                          "InternalServerError")
        config = Path(path) / "adapter_config.json"
        if not config.is_file() or (self.disk is not None and self.disk not in config.parents):
            return _error(404, f"Loading lora {name} failed: No adapter found for {path}",
                          "NotFoundError")
        rank = int(json.loads(config.read_text()).get("r", 0))
        if rank > self.max_lora_rank:
            return _error(500, f"LoRA rank {rank} is greater than max_lora_rank "
                          f"{self.max_lora_rank}.", "InternalServerError")
        key = f"a{uuid.uuid4().hex}"
        try:
            with self._model_lock:
                if self.peft is None:
                    from peft import PeftModel

                    self.peft = PeftModel.from_pretrained(self.model, path,
                                                          adapter_name=key).eval()
                else:
                    self.peft.load_adapter(path, adapter_name=key)
        except Exception as e:  # vLLM: any engine error on add_lora is a 500
            return _error(500, f"{type(e).__name__}: {e}", "InternalServerError")
        with self._lock:
            self.loras[name] = path
            self._peft_keys[name] = key
            self.loads.append(name)
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def _unload(self, body: dict) -> tuple:
        name = body.get("lora_name")
        with self._lock:
            if not name:
                return _error(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                              "InvalidUserInput")
            if name not in self.loras:
                return _error(404, f"The lora adapter '{name}' cannot be found.",
                              "NotFoundError")
            del self.loras[name]  # vLLM drops the name only (its LoRA cache evicts later)
        return 200, f"Success: LoRA adapter '{name}' removed successfully."

    def _completions(self, body: dict, h: BaseHTTPRequestHandler) -> tuple | None:
        problem = self._check(body)
        if problem is not None:
            return problem
        with self._lock:
            self.completions.append(body)
            key = self._peft_keys.get(body.get("model") or "")
            self._in_flight += 1
        try:
            prompt = body["prompt"]
            if isinstance(prompt, str) or not self.honour_token_ids:
                text = prompt if isinstance(prompt, str) else \
                    self.tokenizer.decode(prompt, skip_special_tokens=True)
                prompt = self.tokenizer(text, add_special_tokens=body.get(
                    "add_special_tokens", True))["input_ids"]
            choices = []
            for i in range(body.get("n", 1)):
                seed = body.get("seed")
                choice = self._sample(body, list(prompt), key, None if seed is None else seed + i,
                                      h)
                if choice is None:
                    with self._lock:
                        self.aborted += 1
                    h.close_connection = True
                    return None
                choice["index"] = i
                choices.append(choice)
        finally:
            with self._lock:
                self._in_flight -= 1
        done = sum(len(c["token_ids"]) for c in choices)
        response = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                    "created": int(time.time()), "model": body.get("model") or self.served_name,
                    "choices": choices,
                    "usage": {"prompt_tokens": len(prompt), "completion_tokens": done,
                              "total_tokens": len(prompt) + done}}
        for c in choices:
            if not body.get("return_token_ids"):
                c["token_ids"] = c["prompt_token_ids"] = None
        if self.mutate is not None:
            response = self.mutate(response)
        return 200, response

    def _check(self, body: dict) -> tuple | None:
        """vLLM's request checks that matter here (``_check_model``, SamplingParams bounds)."""
        model = body.get("model")
        with self._lock:
            known = not model or model == self.served_name or model in self.loras
        if not known:
            return _error(404, f"The model `{model}` does not exist. Valid aliases: "
                          f"{self.served_name}.", "NotFoundError", "model")
        t = body.get("temperature", 1.0)
        if t is None or not 0 <= t <= 2:
            return _error(400, f"temperature must be in [0, 2], got {t}.", "BadRequestError",
                          "temperature")
        if not 0 < body.get("top_p", 1.0) <= 1:
            return _error(400, "top_p must be in (0, 1].", "BadRequestError", "top_p")
        if body.get("n", 1) > 1 and t < SAMPLING_EPS:
            return _error(400, "n must be 1 when using greedy sampling.", "BadRequestError")
        if (body.get("logprobs") or 0) > 20 or (body.get("prompt_logprobs") or 0) > 20:
            return _error(400, "Requested logprobs above max_logprobs 20.", "BadRequestError")
        return None

    # -- the sampler -------------------------------------------------------------------------

    def _logits(self, ids: list[int], key: str | None):
        torch = self.torch
        with self._model_lock, torch.no_grad():
            x = torch.tensor([ids])
            if key is None:
                if self.peft is None:
                    return self.model(input_ids=x).logits[0].float()
                with self.peft.disable_adapter():
                    return self.peft(input_ids=x).logits[0].float()
            self.peft.set_adapter(key)
            return self.peft(input_ids=x).logits[0].float()

    def _process(self, logits, t: float, k: int, p: float):
        """vLLM's processed logits: temperature, then top-k, then top-p (ascending mask)."""
        torch = self.torch
        z = logits / max(t, MAX_TEMP)
        if 0 < k < z.shape[-1]:
            kth = torch.topk(z, k).values[-1]
            z = z.masked_fill(z < kth, -math.inf)
        if p < 1:
            sort, idx = z.sort(descending=False)
            cum = sort.softmax(-1).cumsum(-1)
            mask = cum <= 1 - p
            mask[-1] = False
            z = z.scatter(0, idx, sort.masked_fill(mask, -math.inf))
        return z

    def _sample(self, body: dict, prompt: list[int], key: str | None, seed: int | None,
                h: BaseHTTPRequestHandler) -> dict | None:
        torch = self.torch
        t, k, p = body.get("temperature", 1.0), body.get("top_k") or 0, body.get("top_p", 1.0)
        max_tokens = min(body.get("max_tokens", 16), self.max_model_len - len(prompt))
        stops = set(body.get("stop_token_ids") or [])
        eos = self.tokenizer.eos_token_id
        gen = torch.Generator().manual_seed(seed) if seed is not None else torch.Generator()
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        n_top = body.get("logprobs")
        ids, values, tops, reason = [], [], [], "length"
        for _ in range(max_tokens):
            if self.step_delay:
                time.sleep(self.step_delay)
                if _client_gone(h.connection):
                    return None
            logits = self._logits(prompt + ids, key)[-1]
            raw = torch.log_softmax(logits, -1)
            if t < SAMPLING_EPS:
                token, processed = int(logits.argmax()), raw
            else:
                z = self._process(logits, t, k, p)
                processed = torch.log_softmax(z, -1)
                q = torch.empty_like(z).exponential_(generator=gen)
                token = int((z.softmax(-1) / q).argmax())
            shown = processed if self.logprobs_mode == "processed_logprobs" else raw
            ids.append(token)
            values.append(max(float(shown[token]), -9999.0))
            if n_top is not None:
                order = [token, *torch.topk(shown, n_top).indices.tolist()] if n_top else [token]
                tops.append({self._token(i, as_ids): max(float(shown[i]), -9999.0)
                             for i in order})
            if token == eos or token in stops:
                reason = "stop"
                break
        choice = {"text": self.tokenizer.decode(ids), "finish_reason": reason,
                  "stop_reason": ids[-1] if reason == "stop" and ids[-1] != eos else None,
                  "token_ids": ids, "prompt_token_ids": prompt,
                  "logprobs": None if n_top is None else {
                      "text_offset": list(range(len(ids))), "token_logprobs": values,
                      "tokens": [self._token(i, as_ids) for i in ids], "top_logprobs": tops}}
        if body.get("prompt_logprobs") is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(prompt, key,
                                                              body["prompt_logprobs"])
        return choice

    def _prompt_logprobs(self, prompt: list[int], key: str | None, n: int) -> list:
        torch = self.torch
        raw = torch.log_softmax(self._logits(prompt, key), -1)  # always raw (no sampler)
        rows: list[dict | None] = [None]
        for pos in range(1, len(prompt)):
            row = raw[pos - 1]
            order = [prompt[pos], *torch.topk(row, n).indices.tolist()] if n else [prompt[pos]]
            rows.append({str(i): {"logprob": max(float(row[i]), -9999.0),
                                  "rank": int((row > row[i]).sum()) + 1,
                                  "decoded_token": self.tokenizer.decode([i])} for i in order})
        return rows

    def _token(self, token: int, as_ids: bool) -> str:
        return f"token_id:{token}" if as_ids else self.tokenizer.decode([token])


def _client_gone(conn: socket.socket) -> bool:
    """The client closed its connection (readable with nothing to read)."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True
