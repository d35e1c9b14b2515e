"""Debian's headless Chromium for the page tests: where it is and the flags it runs with here."""

from __future__ import annotations

CHROMIUM = "/usr/bin/chromium"
#: no sandbox (root in CI), no GPU, and nothing that reaches for the network on its own
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
