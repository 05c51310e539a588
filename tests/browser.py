"""A headless Chromium driven over the Chrome DevTools Protocol, for the tests that look at a
page as a person would (``from browser import Browser, chromium_or_skip``).

Debian's ``chromium`` (the Makefile's ``tools`` target installs it) runs headless with its
DevTools endpoint on a free loopback port; each page is one websocket (``websockets``' sync
client) on which the tests evaluate JavaScript against the live DOM and take screenshots.
"""

from __future__ import annotations

import base64
import itertools
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from waiting import wait_for

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium_path() -> str | None:
    """The Chromium (or Chrome) executable on PATH, or None."""
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


def chromium_or_skip() -> str:
    """The Chromium executable; without one the calling test is skipped, saying so loudly."""
    path = chromium_path()
    if path is None:
        pytest.skip("NO BROWSER: Debian's `chromium` is not installed, so the dashboard's "
                    "browser test did NOT run. `make tools` installs it (apt-get install "
                    "chromium); on a machine where it cannot, this test stays skipped.")
    return path


class Page:
    """One tab: ``evaluate`` JavaScript, ``screenshot``."""

    def __init__(self, ws_url: str) -> None:
        from websockets.sync.client import connect

        self._ws = connect(ws_url, max_size=64 * 2**20, open_timeout=30)
        self._ids = itertools.count(1)

    def call(self, method: str, timeout_s: float = 30.0, **params: Any) -> dict[str, Any]:
        """Send one CDP command; return its result (events in between are skipped).

        Raises:
            RuntimeError: the browser answered with an error.
        """
        call_id = next(self._ids)
        self._ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            message = json.loads(self._ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def goto(self, url: str, timeout_s: float = 30.0) -> None:
        """Navigate to ``url`` and return once its document has loaded (its scripts ran).

        Raises:
            AssertionError: not loaded within ``timeout_s``.
        """
        self.call("Page.enable")
        self.call("Page.navigate", url=url)

        def loaded() -> bool:
            state = self.evaluate("[document.readyState, location.href]")
            return bool(state) and state[0] == "complete" and state[1] != "about:blank"

        wait_for(loaded, timeout_s, f"{url} to load", every_s=0.05)

    def evaluate(self, expression: str) -> Any:
        """The value of ``expression`` in the page (JSON-serialisable; promises awaited).

        Raises:
            RuntimeError: the expression threw.
        """
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path, width: int = 1400, height: int = 1100) -> Path:
        """A PNG of the page at ``width`` x its full height (at least ``height``)."""
        full = self.evaluate("document.documentElement.scrollHeight") or height
        self.call("Emulation.setDeviceMetricsOverride", width=width,
                  height=max(height, int(full)), deviceScaleFactor=1, mobile=False)
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(data["data"]))
        return path

    def close(self) -> None:
        self._ws.close()


class Browser:
    """A headless Chromium with its own profile; :meth:`page` opens a tab."""

    def __init__(self, executable: str) -> None:
        self._profile = tempfile.TemporaryDirectory(prefix="gridrl-chromium-")
        self.proc = subprocess.Popen(
            [executable, "--headless=new", "--no-sandbox", "--disable-gpu",
             "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
             "--disable-extensions", "--disable-background-networking", "--mute-audio",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
             f"--user-data-dir={self._profile.name}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.port = self._devtools_port()
        self._pages: list[Page] = []
        # keep reading its stderr, or a chatty browser blocks on a full pipe
        threading.Thread(target=self.proc.stderr.read, name="chromium-stderr",
                         daemon=True).start()

    def _devtools_port(self, timeout_s: float = 60.0) -> int:
        """The port of ``DevTools listening on ws://127.0.0.1:PORT/...`` on stderr."""
        deadline = time.monotonic() + timeout_s
        seen = []
        assert self.proc.stderr is not None
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"chromium exited {self.proc.wait()}: {''.join(seen)}")
            seen.append(line)
            found = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
            if found:
                return int(found.group(1))
        raise RuntimeError(f"chromium's DevTools did not start in {timeout_s}s: {''.join(seen)}")

    def page(self, url: str) -> Page:
        """A new tab at ``url``."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/json/new?about:blank",
                                         method="PUT")
        with urllib.request.urlopen(request, timeout=30) as response:
            target = json.loads(response.read())
        page = Page(target["webSocketDebuggerUrl"])
        self._pages.append(page)
        page.goto(url)
        return page

    def close(self) -> None:
        for page in self._pages:
            try:
                page.close()
            except Exception:
                pass
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._profile.cleanup()
