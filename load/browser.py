"""The web client (web/) in a real Chromium, driven by Playwright, with a WAV as its microphone.

Debian's ``chromium`` (scripts/install.sh --system installs it) is launched through Playwright's
``executable_path``: Playwright's own browser download cannot work here. Chromium's fake capture
device plays the WAV into ``getUserMedia`` once (``%noloop``), then silence. The page's own
measurements are in ``window.gapless`` (web/app.js); :class:`Page` reads them.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from pipeline.audio import write_wav
from pipeline.audio_constants import USER_RATE

CHROMIUM = os.environ.get("GAPLESS_CHROMIUM", "/usr/bin/chromium")


def available() -> bool:
    try:
        import playwright  # noqa: F401
    except ImportError:
        return False
    return shutil.which(CHROMIUM) is not None or Path(CHROMIUM).exists()


def chromium_args(mic_wav: str | None) -> list[str]:
    """Headless Chromium for a sealed machine: no background networking, a fake microphone and
    camera, permission prompts answered yes, audio allowed to play without a gesture."""
    args = ["--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-quic", "--disable-gpu", "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
            "--autoplay-policy=no-user-gesture-required"]
    if mic_wav:
        args.append(f"--use-file-for-fake-audio-capture={mic_wav}%noloop")
    # Chromium's sandbox refuses to run as root and needs user namespaces a CI container may not
    # give; the pages this browser opens are the project's own, on loopback.
    args.append("--no-sandbox")
    return args


def write_mic_wav(path: Path, pcm16k: np.ndarray) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_wav(str(path), pcm16k, USER_RATE)
    return str(path)


class Page:
    """One page of the web client. ``with Page(url, mic_wav) as page: page.connect()``."""

    def __init__(self, url: str, mic_wav: str | None = None, console: list[str] | None = None,
                 ignore_https_errors: bool = False):
        self.url = url
        self.ignore_https_errors = ignore_https_errors  # a self-signed certificate (scripts/dev_cert.sh)
        self.mic_wav = mic_wav
        self.console = console if console is not None else []

    def __enter__(self) -> "Page":
        from playwright.sync_api import sync_playwright

        self._pw = sync_playwright().start()
        self.browser = self._pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                                args=chromium_args(self.mic_wav))
        self.page = self.browser.new_page(viewport={"width": 1000, "height": 900},
                                          ignore_https_errors=self.ignore_https_errors)
        self.page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}"))
        self.page.on("pageerror", lambda e: self.console.append(f"pageerror: {e}"))
        self.page.goto(self.url)
        return self

    def __exit__(self, *exc) -> None:
        self.browser.close()
        self._pw.stop()

    def state(self) -> dict:
        """window.gapless, as plain data."""
        return self.page.evaluate("() => JSON.parse(JSON.stringify(window.gapless))")

    def wait(self, js: str, timeout_s: float = 30) -> None:
        """Until the JS expression (over ``g`` = window.gapless) is true."""
        self.page.wait_for_function(f"() => {{ const g = window.gapless; return {js}; }}", timeout=timeout_s * 1000)

    def connect(self, token: str | None = None, timeout_s: float = 30) -> None:
        if token:
            self.page.fill("#token", token)
        self.page.click("#connect")
        self.wait("g.status.startsWith('connected') || g.status.startsWith('not connected')", timeout_s)

    def type_turn(self, text: str) -> None:
        self.page.fill("#text", text)
        self.page.click("#send")

    def screenshot(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(path), full_page=True)

    def wait_turn_done(self, turn: int, timeout_s: float = 60) -> dict:
        self.wait(f"g.turns[{turn}] && g.turns[{turn}].interrupted !== null", timeout_s)
        return self.state()["turns"][str(turn)]

    def wait_played(self, more_than: int, timeout_s: float = 30) -> None:
        self.wait(f"g.playback.played > {more_than}", timeout_s)

