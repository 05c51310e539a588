"""Whether a hub id (``org/name``) can be loaded on this machine, decided in a few seconds
instead of by the loader's retries: a copy in the local Hugging Face cache, or a hub that
accepts a TCP connection.

    local_copy("HuggingFaceTB/SmolLM2-135M-Instruct")  # its snapshot directory, or None
    hub_reachable()                                     # False without network (<= 3 s)

``HF_HUB_OFFLINE`` set means no network (as huggingface_hub reads it); ``HF_ENDPOINT`` names
the hub; with ``HTTPS_PROXY`` / ``ALL_PROXY`` set, the proxy is what must answer.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import getproxies

CONNECT_TIMEOUT_S = 3.0
_DEFAULT_ENDPOINT = "https://huggingface.co"


def local_copy(repo_id: str) -> Path | None:
    """The directory of ``repo_id``'s snapshot in the local Hugging Face cache (the revision
    ``main`` points to), or None when there is none (or huggingface_hub is not installed)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError), or a malformed id
        return None
    return path if (path / "config.json").is_file() else None


def offline() -> bool:
    """``HF_HUB_OFFLINE`` is set to a true value (1, true, yes, on)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_host() -> tuple[str, int]:
    """``(host, port)`` a hub download connects to first: the proxy when one is set, else
    ``HF_ENDPOINT`` (default huggingface.co:443)."""
    proxies = getproxies()  # the *_proxy variables, in either case
    url = (proxies.get("https") or proxies.get("all") or os.environ.get("HF_ENDPOINT")
           or _DEFAULT_ENDPOINT)
    parts = urlsplit(url if "://" in url else f"http://{url}")
    return parts.hostname or "huggingface.co", parts.port or (443 if parts.scheme == "https"
                                                              else 80)


def hub_reachable(timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether the hub (or the proxy to it) accepts a TCP connection within ``timeout_s``,
    name resolution included (which socket timeouts do not bound: the attempt runs on a
    daemon thread that is left behind when it takes longer); False at once when
    :func:`offline`."""
    if offline():
        return False
    host, port = hub_host()
    done, answered = threading.Event(), threading.Event()

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            answered.set()
        except OSError:
            pass
        finally:
            done.set()

    threading.Thread(target=connect, name="hub-probe", daemon=True).start()
    done.wait(timeout_s)
    return answered.is_set()
