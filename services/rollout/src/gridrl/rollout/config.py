"""A rollout node's settings: every ``gridrl-rollout serve`` setting, declared once.

Each setting is one field of :class:`NodeConfig`, declared with
:func:`gridrl.common.settings.setting`: from it come the ``serve`` flag, its
``GRIDRL_ROLLOUT_<FLAG>`` environment variable, its help, its default (for the command line,
:class:`gridrl.rollout.server.RolloutNode` and :class:`gridrl.rollout.scheduler.BatchScheduler` alike)
and its check (:meth:`NodeConfig.validate`). ``--listen``, ``--metrics-port`` and the security
flags come from :func:`gridrl.common.cli.server_options` (``cli=False`` here); ``security`` is
no setting (the flags build it at each start).
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gridrl.common import settings
from gridrl.common.address import parse_address, parse_listen
from gridrl.common.errors import invalid_argument
from gridrl.common.rpc.channel import Keepalive
from gridrl.common.settings import NON_NEGATIVE, POSITIVE, above, at_least, setting
from gridrl.models import cache_root

ENV_PREFIX = "GRIDRL_ROLLOUT_"
_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


def _directory(value: str) -> str | None:
    return f"{value} is a file, not a directory" if Path(value).is_file() else None


def _device(value: str) -> str | None:
    return None if _DEVICE.match(value) else (f"{value!r} is not one of auto, cpu, cuda, "
                                              "cuda:N, mps")


@dataclass
class NodeConfig:
    """How a node serves (see ``gridrl-rollout serve --help`` for each flag)."""

    # serving (flags from gridrl.common.cli.server_options)
    listen: str = setting("127.0.0.1:50051", "host:port to bind (port 0: any free port).",
                          cli=False)
    metrics_port: int = setting(-1, "Prometheus port (0: any free port, negative: off; the "
                                "serve command's default is 9401).", cli=False)
    # the model and where it runs
    backend: str = setting(
        "torch", "Inference backend (vllm: front a vLLM server on this machine, --vllm-url).",
        choices=("torch", "mlx", "vllm"))
    model: str = setting(
        "smollm2-135m-instruct", "Hub id, local directory, or alias (smollm2-135m-instruct "
        "works offline); vllm: the model vLLM serves (tokenizer and config are read from it).")
    vllm_url: str | None = setting(
        None, "vllm: base URL of the vLLM OpenAI server, e.g. http://127.0.0.1:8000 (vLLM "
        "reads pushed adapters from this machine's --adapter-root).")
    vllm_api_key_file: str | None = setting(
        None, "vllm: file holding one of vLLM's --api-key values.")
    device: str = setting("auto", "auto, cpu, cuda, cuda:N or mps (mlx: auto, cpu, or mps for "
                          "the Apple GPU).", check=_device)
    dtype: str = setting("auto", "Compute dtype (auto: float32 on CPU, bfloat16 on CUDA; mlx: "
                         "as stored).", choices=("auto", "float32", "bfloat16", "float16"))
    forward: str = setting(
        "lean", "torch: lean runs llama-family models through gridrl's fused forward "
        "(prepacked weights on CPU, adapters as LoRA factors); transformers runs the model's "
        "own forward with adapters merged. Other architectures always use transformers.",
        choices=("lean", "transformers"))
    threads: int = setting(
        0, "torch intra-op CPU threads (0: one per core that other processes leave free, "
        "re-decided every half second of decoding). Idle OpenMP threads spin briefly, then "
        "sleep (GOMP_SPINCOUNT=10000 unless set).", check=NON_NEGATIVE)
    # bounds
    capacity: int = setting(64, "Most sequences decoded together in one batch.", check=POSITIVE)
    prefix_cache_mb: int = setting(
        256, "torch, lean forward: MB of keys/values kept for multi-turn continuations (a "
        "Generate with keep_cache; the episode's next turn prefills only its new tokens), least "
        "recently used evicted first (0: off).", check=NON_NEGATIVE)
    max_queue: int = setting(
        128, "Most Generate requests waiting; past it they get RESOURCE_EXHAUSTED.",
        check=POSITIVE)
    max_n: int = setting(64, "Largest sampling.n a request may ask for.", check=POSITIVE)
    max_tokens: int = setting(2048, "Largest sampling.max_tokens a request may ask for.",
                              check=POSITIVE)
    kv_memory_mb: float = setting(
        0.0, "MB (10^6 bytes) the node may use for its KV cache and sampling buffers (0: half "
        "the memory available once the model is loaded). It holds that many KV-cache tokens, "
        "advertises them, batches within them and refuses a request one of whose sequences "
        "does not fit with RESOURCE_EXHAUSTED.", check=NON_NEGATIVE)
    max_adapter_bytes: int = setting(512 << 20, "Largest adapter push accepted, in bytes.",
                                     check=POSITIVE)
    max_resident_adapters: int = setting(
        4, "Adapters (runs) held loaded at once; a batch decodes rows of any of them and of "
        "the base model together. Past it the least recently used is unloaded (a Generate "
        "naming it then gets NOT_FOUND until it is pushed or reloaded again).", check=POSITIVE)
    adapter_memory_mb: float = setting(
        0.0, "MB (10^6 bytes) the loaded adapters may take in all (0: not limited beyond "
        "--max-resident-adapters); least recently used unloaded past it; a push larger than "
        "it alone is refused with RESOURCE_EXHAUSTED.", check=NON_NEGATIVE)
    # adapters on disk
    keep_adapters: int = setting(
        8, "Pushed versions kept on disk per adapter name, newest first (0: all).",
        check=NON_NEGATIVE)
    keep_runs: int = setting(
        4, "Adapter names (runs) kept on disk, by latest push (0: all); names other than the "
        "one pushed keep only their newest version.", check=NON_NEGATIVE)
    adapter_root: str | None = setting(
        None, "Directory of the node's adapters (pushed ones, and those ReloadAdapter may load "
        "by path) [default: <gridrl cache>/rollout/<name>/adapters].", check=_directory)
    # the master
    master: str | None = setting(None, "host:port of the master to register with and "
                                 "heartbeat.")
    max_refusals: int = setting(
        5, "Refusals in a row of this node's credential by the master (UNAUTHENTICATED, or "
        "PERMISSION_DENIED: e.g. an address another credential holds) after which the node "
        "exits non-zero with the master's message, so a supervisor shows it failed (0: retry "
        "for ever). From the first refusal its health is NOT_SERVING.", check=NON_NEGATIVE)
    keepalive_s: float = setting(
        10.0, "Seconds between HTTP/2 keepalive pings on the node's channels to the master and "
        "to the nodes it reads relayed adapters from. A master or relay source whose link "
        "vanished (Wi-Fi down, lid closed: no RST) is noticed after about --keepalive-s + "
        "--keepalive-timeout-s and its connection closed: later relayed reads from it fail at "
        "once (the read moves to the next holder) instead of each waiting the relay's stall "
        "limit, a heartbeat in flight fails then if that is sooner than its own 5 s deadline, "
        "and once the link is back a fresh connection is made.", check=at_least(1))
    keepalive_timeout_s: float = setting(
        5.0, "Seconds a keepalive ping of the node's channels may go unanswered before the "
        "connection is dropped.", check=above(0))
    advertise_address: str | None = setting(
        None, "host:port to register with the master [default: the bound address].")
    name: str | None = setting(None, "Node name for logs and the default adapter root "
                               "[default: <hostname>-<port>].")
    openai_listen: str | None = setting(
        None, "host:port of an OpenAI-compatible HTTP endpoint (/v1/models, /v1/completions, "
        "/v1/chat/completions; port 0: any free port) [default: off]. It shares the engine "
        "queue and the bearer token with gRPC; needs gridrl-rollout[openai].")
    # not flags: the scheduler's batching window and the shutdown grace
    batch_window_s: float = setting(0.005, "How long an idle scheduler waits for concurrent "
                                    "requests, in seconds.", cli=False, check=NON_NEGATIVE)
    grace_s: float = setting(10.0, "Seconds calls in flight get to finish on shutdown.",
                             cli=False, check=above(0))
    # TLS files, the credentials the node accepts and the token it sends to the master
    # (gridrl.common.security.policy.Security; None: plaintext, no credentials, loopback only)
    security: Any = field(default=None, repr=False, compare=False)

    def keepalive(self) -> Keepalive:
        """The keepalive of the node's own channels (master, relay sources) from
        ``--keepalive-s`` and ``--keepalive-timeout-s``."""
        return Keepalive(self.keepalive_s, self.keepalive_timeout_s)

    def validate(self) -> None:
        """Raise INVALID_ARGUMENT naming the first bad flag: each setting's own check, the
        addresses, then the rules between settings (the mlx backend's dtype and device, the
        --vllm-* flags against --backend).

        Raises:
            StatusError: INVALID_ARGUMENT, ``field`` the flag.
        """
        settings.validate(self)
        for flag, value, parse in (("--listen", self.listen, parse_listen),
                                   ("--master", self.master, parse_address),
                                   ("--advertise-address", self.advertise_address,
                                    parse_address),
                                   ("--openai-listen", self.openai_listen, parse_listen)):
            if value is not None:
                parse(value, flag)
        if self.backend == "mlx" and self.dtype != "auto":
            raise invalid_argument("--dtype", "the mlx backend computes in the stored dtype; "
                                              "use auto")
        if self.backend == "mlx" and self.device.startswith("cuda"):
            raise invalid_argument("--device", "the mlx backend runs on cpu or the Apple GPU "
                                               "(mps)")
        self._check_vllm()

    def _check_vllm(self) -> None:
        if self.backend != "vllm":
            for flag, value in (("--vllm-url", self.vllm_url),
                                ("--vllm-api-key-file", self.vllm_api_key_file)):
                if value is not None:
                    raise invalid_argument(flag, "only with --backend vllm")
            return
        if self.vllm_url is None:
            raise invalid_argument("--vllm-url", "required with --backend vllm")
        parts = urlsplit(self.vllm_url)
        if parts.scheme not in ("http", "https") or not parts.hostname or \
                parts.path not in ("", "/"):
            raise invalid_argument("--vllm-url", f"{self.vllm_url!r} is not a base URL like "
                                                 "http://127.0.0.1:8000")
        for flag, value in (("--device", self.device), ("--dtype", self.dtype)):
            if value != "auto":
                raise invalid_argument(flag, "vLLM chooses its own; set it on vLLM")
        if self.vllm_api_key_file is not None:
            self.vllm_api_key()

    def vllm_api_key(self) -> str | None:
        """The API key in ``--vllm-api-key-file`` (None without one).

        Raises:
            StatusError: INVALID_ARGUMENT ``--vllm-api-key-file`` when unreadable or empty.
        """
        if self.vllm_api_key_file is None:
            return None
        try:
            key = Path(self.vllm_api_key_file).read_text().strip()
        except OSError as e:
            raise invalid_argument("--vllm-api-key-file", f"cannot read "
                                   f"{self.vllm_api_key_file}: {e.strerror or e}") from e
        if not key:
            raise invalid_argument("--vllm-api-key-file", f"{self.vllm_api_key_file} is empty")
        return key


def default_of(name: str) -> Any:
    """The declared default of setting ``name`` (the engine's and the CLI's)."""
    return settings.default_of(NodeConfig, name)


def node_name(config: NodeConfig) -> str:
    """``config.name``, else ``<hostname>-<port>`` (``pid<pid>`` for port 0)."""
    return config.name or default_name(config.listen)


def default_name(listen: str) -> str:
    """``<hostname>-<port>`` of a node listening on ``listen``; ``<hostname>-pid<pid>`` for
    port 0 (a new port each start: a name never reused)."""
    port = listen.rpartition(":")[2]
    suffix = port if port not in ("", "0") else f"pid{os.getpid()}"
    return f"{socket.gethostname()}-{suffix}"


def adapter_root(config: NodeConfig) -> Path:
    """The node's adapter directory: ``config.adapter_root``, else
    ``<gridrl cache>/rollout/<node name>/adapters`` (a vllm backend lands adapters under it
    before the node starts)."""
    if config.adapter_root:
        return Path(config.adapter_root)
    return cache_root() / "rollout" / node_name(config) / "adapters"
