"""Status lines (gridrl.common.progress): plain log lines at growing intervals off a terminal
(no cursor escapes), a live redrawn line on a terminal with log records printed above it,
nothing for short waits, and statuses that end by themselves."""

from __future__ import annotations

import io
import logging
import threading

import pytest
from rich.console import Console
from waiting import wait_for

from gridrl.common.progress import StatusLine, status_text


@pytest.fixture
def logger(caplog: pytest.LogCaptureFixture) -> logging.Logger:
    caplog.set_level(logging.INFO, logger="test.progress")
    return logging.getLogger("test.progress")


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "test.progress"]


def test_status_text() -> None:
    assert status_text("waiting for the master", 12.7) == "waiting for the master (12s)"
    assert status_text("waiting for 2 nodes", 12.2, timeout_s=60) == \
        "waiting for 2 nodes (12s, 47s left)"
    assert status_text("x", 125, timeout_s=100) == "x (2m05s, 0s left)"


def test_off_a_terminal_it_logs_plain_lines_at_growing_intervals(caplog, logger) -> None:
    stream = io.StringIO()
    line = StatusLine("waiting for the master at m:1", stream=stream, logger=logger,
                      delay_s=0, log_every_s=0.05, max_log_every_s=0.1).start()
    wait_for(lambda: len(_messages(caplog)) >= 3)
    line.update("waiting for the master at m:2")
    wait_for(lambda: any("m:2 (" in m for m in _messages(caplog)))
    line.stop()
    messages = _messages(caplog)
    assert messages[0].startswith("waiting for the master at m:1 (") and messages[0][-2:] == "s)"
    assert messages[-1].startswith("waiting for the master at m:2: done after ")
    assert stream.getvalue() == ""  # nothing but log records: no cursor escapes anywhere
    assert not any("\x1b" in m for m in messages)
    line.stop()  # idempotent
    assert len(_messages(caplog)) == len(messages)


def test_short_waits_show_nothing(caplog, logger) -> None:
    with StatusLine("converting", stream=io.StringIO(), logger=logger, delay_s=30):
        pass
    assert _messages(caplog) == []


def test_until_ends_the_status_by_itself(caplog, logger) -> None:
    registered = threading.Event()
    line = StatusLine("waiting for the master", until=registered.is_set, logger=logger,
                      stream=io.StringIO(), delay_s=0, log_every_s=0.05).start()
    wait_for(lambda: len(_messages(caplog)) >= 1)
    assert line.active
    registered.set()
    wait_for(lambda: not line.active)
    assert _messages(caplog)[-1].startswith("waiting for the master: done after ")


def test_a_failure_is_said_on_exit(caplog, logger) -> None:
    with pytest.raises(ValueError), StatusLine("writing checkpoint", logger=logger,
                                               stream=io.StringIO(), delay_s=0,
                                               log_every_s=0.01) as line:
        wait_for(lambda: line.shown)
        raise ValueError("disk full")
    assert _messages(caplog)[-1].startswith("writing checkpoint: failed (ValueError) after ")


def test_on_a_terminal_it_redraws_and_log_records_print_above(caplog, logger) -> None:
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=100)
    handler = logging.StreamHandler(screen)
    logger.addHandler(handler)
    try:
        first = StatusLine("waiting for the master", console=console, logger=logger,
                           delay_s=0).start()
        second = StatusLine("waiting for a first adapter", console=console, logger=logger,
                            delay_s=0, timeout_s=600).start()
        wait_for(lambda: "waiting for a first adapter (" in screen.getvalue()
                   and "waiting for the master (" in screen.getvalue())
        assert "\x1b[" in screen.getvalue()  # a terminal: the lines are redrawn in place
        assert handler.stream is not screen  # records go through the live display
        long_record = "a log record while the lines show, longer than the screen " * 3
        logger.info(long_record)
        wait_for(lambda: long_record + "\n" in screen.getvalue())  # whole: not re-wrapped
        first.stop()
        second.stop()
        wait_for(lambda: handler.stream is screen)  # handed back once nothing shows
        assert "left)" in screen.getvalue()
        assert _messages(caplog)[-1].startswith("waiting for a first adapter: done after ")
    finally:
        logger.removeHandler(handler)


@pytest.mark.real_model
def test_model_conversion_says_what_it_is_doing(caplog, tmp_path) -> None:
    """The first use of the bundled model converts its GGUF (about 20 s): a status line, not
    silence (here: plain log lines, as in a service's log)."""
    from gridrl.models import resolve_model

    caplog.set_level(logging.INFO, logger="gridrl.models.resolve")
    target = resolve_model("smollm2-135m-instruct", cache_dir=tmp_path)
    assert (target / "model.safetensors").exists()
    lines = [r.getMessage() for r in caplog.records if r.name == "gridrl.models.resolve"]
    steps = [m for m in lines if m.startswith("converting SmolLM2-135M-Instruct.Q4_1.gguf once (")]
    assert steps and all("/3: " in m and m.endswith("s)") for m in steps)
    assert lines[-1].startswith("converting SmolLM2-135M-Instruct.Q4_1.gguf once: done after ")


def test_progress_bars_are_off_when_stderr_is_not_a_terminal() -> None:
    """A service's logging setup, off a terminal (a log file, a pipe), turns tqdm's and the
    Hugging Face libraries' bars off: no carriage returns in the log (issue 20)."""
    import subprocess
    import sys

    code = ("from gridrl.common.cli import setup_logging; setup_logging('info'); "
            "from tqdm import tqdm; list(tqdm(range(3), desc='bar')); "
            "from transformers.utils import logging as hf; "
            "assert not hf.is_progress_bar_enabled()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120,
                          env={k: v for k, v in __import__("os").environ.items()
                               if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")})
    assert done.returncode == 0, done.stderr
    assert b"\r" not in done.stderr and b"bar" not in done.stderr, done.stderr
