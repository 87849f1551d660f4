#!/usr/bin/env python
"""Screenshots of the portal's main pages for docs/portal.md, taken from a running server.

    make demo &                       # or any Orrery with the demo logins
    .venv/bin/python scripts/screenshots.py http://127.0.0.1:8000

Uses Debian's Chromium (/usr/bin/chromium) through Playwright; writes docs/screenshots/*.png.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

OUT = Path(__file__).resolve().parents[1] / "docs/screenshots"


def sign_in(page, server: str, user: str) -> None:
    page.goto(f"{server}/accounts/login/")
    page.fill('input[name="username"]', user)
    page.fill('input[name="password"]', user)
    page.click('button[type="submit"]')
    page.wait_for_url(f"{server}/")


def main() -> None:
    server = (sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000").rstrip("/")
    OUT.mkdir(parents=True, exist_ok=True)
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1360, "height": 900})
        sign_in(page, server, "alice")
        shots = {"dashboard": "/", "submit": "/submit/", "jobs": "/jobs/", "clusters": "/clusters/"}
        shots |= {"queues": "/queues/", "fleet": "/fleet/", "cluster": "/clusters/sim-a/"}
        for name, path in shots.items():
            page.goto(f"{server}{path}")
            time.sleep(1.5)  # sockets connect, charts draw
            page.screenshot(path=str(OUT / f"{name}.png"), full_page=True)
        page.goto(f"{server}/jobs/?state=RUNNING")
        page.locator("tr[data-job] a").first.click()
        time.sleep(2.5)  # the log tail arrives
        page.screenshot(path=str(OUT / "job.png"), full_page=True)
        ops = browser.new_page(viewport={"width": 1360, "height": 900})
        sign_in(ops, server, "admin")
        for name, path in {"console": "/admin/", "scheduler": "/admin/scheduler/"}.items():
            ops.goto(f"{server}{path}")
            ops.screenshot(path=str(OUT / f"{name}.png"), full_page=True)
        browser.close()
    print(f"wrote {len(list(OUT.glob('*.png')))} screenshots to {OUT}")


if __name__ == "__main__":
    main()
