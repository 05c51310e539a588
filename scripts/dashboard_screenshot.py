"""Screenshot the master's dashboard of a live run: wait until the page shows ``--steps`` steps,
then save a PNG of the whole page (headless Chromium, the tests' CDP driver).

    .venv/bin/python scripts/dashboard_screenshot.py docs/dashboard.png \
        [--url http://127.0.0.1:8321] [--steps 40] [--timeout-s 1800]

Used for the README's picture: run ``make demo`` in one terminal and this in another.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from browser import Browser, chromium_path
from waiting import wait_for


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--url", default="http://127.0.0.1:8321")
    parser.add_argument("--steps", type=int, default=40, help="steps shown before the shot")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args()
    executable = chromium_path()
    if executable is None:
        sys.exit("no chromium on PATH: `make tools` installs it")
    browser = Browser(executable)
    try:
        page = browser.page(args.url)

        def steps_shown() -> int:
            text = page.evaluate("(document.getElementById('steps-shown') || {}).textContent")
            return int(text or 0)

        wait_for(lambda: steps_shown() >= args.steps, args.timeout_s,
                 f"{args.steps} steps on the dashboard", every_s=2.0)
        page.screenshot(args.out)
        print(f"wrote {args.out} ({steps_shown()} steps shown)")
    finally:
        browser.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
