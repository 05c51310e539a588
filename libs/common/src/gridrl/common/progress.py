"""Status lines: what a process is waiting for, and for how long, instead of silence.

    with StatusLine("converting smollm2-135m-instruct (once)") as line:
        ...
        line.update("converting smollm2-135m-instruct: saving")

    line = StatusLine("waiting for 2 rollout nodes", timeout_s=60).start()
    ...                                   # "waiting for 2 rollout nodes (12s, 48s left)"
    line.stop()

    StatusLine("waiting for the master at m:50050", until=lambda: registrar.registered).start()

Where it goes:

* on a terminal (the stream is a TTY, and not ``TERM=dumb``): one line per status at the
  bottom of the screen, redrawn in place with a spinner and the seconds waited (and left) by
  rich's live display; log records written meanwhile by the ``logging`` handlers on that stream
  print above the lines instead of through them. Several statuses show together.
* anywhere else (a log file, journald, a pipe): plain ``logging`` records, no cursor escapes:
  the first after ``delay_s``, then after ``log_every_s``, twice that, ... up to
  ``max_log_every_s`` between two lines.

Nothing shows for a wait shorter than ``delay_s``; a status that showed logs one last line when
it stops (``"<what>: done after 14s"``).
"""

from __future__ import annotations

import io
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any, ClassVar

log = logging.getLogger("gridrl.progress")

TICK_S = 0.25  # how often `until` predicates are checked and due log lines written


def status_text(what: str, elapsed_s: float, timeout_s: float | None = None) -> str:
    """``"<what> (12s)"``, or ``"<what> (12s, 48s left)"`` with a timeout; minutes past 90 s
    (``"(2m05s)"``)."""
    parts = [_duration(elapsed_s)]
    if timeout_s is not None:
        parts.append(f"{_duration(max(0.0, timeout_s - elapsed_s))} left")
    return f"{what} ({', '.join(parts)})"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds}s" if seconds < 90 else f"{seconds // 60}m{seconds % 60:02d}s"


class StatusLine:
    """One thing a process waits for (module docstring).

    Args:
        what: what is waited for, e.g. ``"waiting for the master at m:50050"``.
        timeout_s: the wait's deadline from :meth:`start`, to show the seconds left (None:
            no deadline shown). It shows only: nothing stops at the deadline.
        until: checked every :data:`TICK_S` seconds on a background thread; when it returns
            True the status stops by itself (an exception it raises is logged and stops it).
        logger: where the plain lines go (default ``gridrl.progress``).
        stream: the stream whose TTY-ness decides the display (default ``sys.stderr`` at
            :meth:`start`).
        console: a ``rich.console.Console`` to draw on instead of one made for ``stream``.
        delay_s: waits shorter than this show nothing.
        log_every_s: first interval between plain lines (doubling after each line).
        max_log_every_s: the longest interval between plain lines.

    Thread-safe; :meth:`start` and :meth:`stop` are idempotent.
    """

    def __init__(self, what: str, *, timeout_s: float | None = None,
                 until: Callable[[], bool] | None = None, logger: logging.Logger | None = None,
                 stream: IO[str] | None = None, console: Any = None, delay_s: float = 1.0,
                 log_every_s: float = 10.0, max_log_every_s: float = 60.0) -> None:
        self._what = what
        self.timeout_s = timeout_s
        self.until = until
        self.logger = logger or log
        self._stream = stream
        self._console = console
        self.delay_s = delay_s
        self._interval = log_every_s
        self.max_log_every_s = max_log_every_s
        self._lock = threading.Lock()
        self.started_at: float | None = None
        self._next_log: float = 0.0
        self.shown = False
        self._board: _Board | None = None

    @property
    def what(self) -> str:
        return self._what

    @property
    def active(self) -> bool:
        """Started and not stopped yet."""
        return self._board is not None

    def elapsed_s(self, now: float | None = None) -> float:
        """Seconds since :meth:`start` (0 before)."""
        if self.started_at is None:
            return 0.0
        return (time.monotonic() if now is None else now) - self.started_at

    def text(self, now: float | None = None) -> str:
        """The line as shown now (:func:`status_text`)."""
        with self._lock:
            what = self._what
        return status_text(what, self.elapsed_s(now), self.timeout_s)

    def update(self, what: str) -> None:
        """Say what is waited for now (the clock keeps running)."""
        with self._lock:
            self._what = what

    def start(self) -> StatusLine:
        """Begin showing (after ``delay_s``). Returns self."""
        with self._lock:
            if self.started_at is not None:
                return self
            self.started_at = time.monotonic()
            self._next_log = self.started_at + self.delay_s
        self._board = _Board.for_console(self._console, self._stream or sys.stderr)
        self._board.add(self)
        return self

    def stop(self, outcome: str = "done") -> None:
        """Stop showing; if the status showed, log ``"<what>: <outcome> after Ns"``."""
        board, self._board = self._board, None
        if board is None:
            return
        board.remove(self)
        if self.shown:
            self.logger.info("%s: %s after %s", self.what, outcome,
                             _duration(self.elapsed_s()))

    def __enter__(self) -> StatusLine:
        return self.start()

    def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
        self.stop("done" if kind is None else f"failed ({kind.__name__})")

    # -- called by the board's thread -------------------------------------------------------

    def _tick(self, now: float, interactive: bool) -> bool:
        """One tick: False when ``until`` says the wait is over. Off a terminal, logs the line
        when it is due."""
        if self.until is not None:
            try:
                if self.until():
                    return False
            except Exception:
                self.logger.exception("%s: the check of its end failed", self.what)
                return False
        if now - (self.started_at or now) < self.delay_s:
            return True
        self.shown = True
        if not interactive and now >= self._next_log:
            self.logger.info("%s", self.text(now))
            self._next_log = now + self._interval
            self._interval = min(self.max_log_every_s, self._interval * 2)
        return True


class _Board:
    """The status lines drawn on one console: one rich live display for all of them (on a
    terminal) and one thread that ticks them.

    Locks: ``_lock`` guards the lines (the live display's refresh thread takes it to render);
    ``_live_lock`` guards starting and stopping the display and is never taken under ``_lock``.
    """

    _boards: ClassVar[dict[int, _Board]] = {}
    _boards_lock = threading.Lock()

    def __init__(self, console: Any) -> None:
        self.console = console
        self.interactive = bool(console.is_terminal and not console.is_dumb_terminal)
        self._lines: list[StatusLine] = []
        self._lock = threading.Lock()
        self._live_lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._live: Any = None
        self._rerouted: list[tuple[logging.StreamHandler, Any]] = []

    @classmethod
    def for_console(cls, console: Any, stream: IO[str]) -> _Board:
        """The board of ``console`` (when given) or of a console on ``stream``."""
        with cls._boards_lock:
            key = id(console if console is not None else stream)
            board = cls._boards.get(key)
            if board is None:
                if console is None:
                    from rich.console import Console

                    console = Console(file=stream)
                board = cls._boards[key] = _Board(console)
            return board

    def add(self, line: StatusLine) -> None:
        with self._lock:
            self._lines.append(line)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="status-lines",
                                                daemon=True)
                self._thread.start()

    def remove(self, line: StatusLine) -> None:
        with self._lock:
            if line in self._lines:
                self._lines.remove(line)
        self._wake.set()
        self._refresh_live()

    def _run(self) -> None:
        while True:
            now = time.monotonic()
            with self._lock:
                lines = list(self._lines)
                if not lines:
                    self._thread = None  # add() starts a new one
                    break
            for line in lines:
                if not line._tick(now, self.interactive):
                    line.stop()
            self._refresh_live()
            self._wake.wait(TICK_S)
            self._wake.clear()
        self._refresh_live()

    # -- the terminal display --------------------------------------------------------------

    def _shown(self) -> list[StatusLine]:
        with self._lock:
            return [line for line in self._lines if line.shown]

    def _render(self) -> Any:
        from rich.console import Group
        from rich.spinner import Spinner

        return Group(*(Spinner("dots", text=line.text()) for line in self._shown()))

    def _refresh_live(self) -> None:
        """Draw the display while some line is shown (printing log records above it), erase
        it and give the log handlers their stream back when none is."""
        if not self.interactive:
            return
        from rich.live import Live

        with self._live_lock:
            shown = bool(self._shown())
            if shown and self._live is None:
                self._live = Live(get_renderable=self._render, console=self.console,
                                  refresh_per_second=8, transient=True,
                                  redirect_stdout=False, redirect_stderr=False)
                proxy = _PrintAbove(self.console)
                for handler in _handlers_on(self.console.file):
                    self._rerouted.append((handler, handler.setStream(proxy)))
                self._live.start()
            elif not shown and self._live is not None:
                self._live.stop()
                self._live = None
                for handler, stream in self._rerouted:
                    handler.flush()
                    handler.setStream(stream)
                self._rerouted.clear()


class _PrintAbove(io.TextIOBase):
    """The stream of the log handlers while status lines show: each complete line is printed
    by the console above the lines, as it was written (not re-wrapped; ANSI colours kept)."""

    def __init__(self, console: Any) -> None:
        self._console = console
        self._buffer = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        from rich.text import Text

        with self._lock:
            *lines, self._buffer = (self._buffer + text).split("\n")
            for line in lines:
                self._console.print(Text.from_ansi(line), soft_wrap=True)
        return len(text)

    def flush(self) -> None:
        from rich.text import Text

        with self._lock:
            if self._buffer:
                self._console.print(Text.from_ansi(self._buffer), soft_wrap=True)
            self._buffer = ""

    def isatty(self) -> bool:
        return True


def _handlers_on(stream: Any) -> list[logging.StreamHandler]:
    """The ``logging`` stream handlers (of every logger) writing to ``stream``."""
    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in
                                      list(logging.root.manager.loggerDict))]
    out: list[logging.StreamHandler] = []
    for logger in loggers:
        for handler in getattr(logger, "handlers", ()):
            if isinstance(handler, logging.StreamHandler) and handler.stream is stream \
                    and handler not in out:
                out.append(handler)
    return out
