"""The project as a package: a wheel holds what the served app reads at run time (the page, the
serve configs, the voices' clips) and the ``gapless`` command; the gateway starts without the
optional extras (phone, webrtc) and says what is missing where it is needed."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_wheel_holds_the_page_the_configs_the_voices_and_the_command(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("gapless-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in ("deployments/web/index.html", "deployments/web/app.js", "deployments/web/vendor/msgpack.min.js",
                 "deployments/web/worklets/playback.js", "deployments/configs/serve_config.yaml",
                 "deployments/configs/serve_config.gpu.yaml", "pipeline/tts/voices/robot.wav"):
        assert path in names, path
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "gapless = deployments.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    assert (ROOT / "web" / "index.html").read_bytes() == zipfile.ZipFile(wheel).read("deployments/web/index.html")


def test_the_gapless_command_lists_serve_talk_and_check_and_check_reports_the_machine():
    helped = subprocess.run([sys.executable, "-m", "deployments.cli", "--help"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert helped.returncode == 0 and all(c in helped.stdout for c in ("serve", "talk", "check"))
    talk_help = subprocess.run([sys.executable, "-m", "deployments.cli", "talk", "--help"], capture_output=True,
                               text=True, timeout=120, cwd=ROOT)
    assert talk_help.returncode == 0 and "gapless talk" in talk_help.stdout and "--text" in talk_help.stdout
    checked = subprocess.run([sys.executable, "-m", "deployments.cli", "check", "--port", "9"], capture_output=True,
                             text=True, timeout=120, cwd=ROOT)
    assert checked.returncode == 0, checked.stderr
    assert "torch build: CPU" in checked.stdout or "torch build: CUDA" in checked.stdout
    assert "checkpoints in the cache:" in checked.stdout and "port 9 free: True" in checked.stdout


WITHOUT_EXTRAS = """
import sys
for name in ("twilio", "telnyx", "aiortc", "aioice"):  # PyAV (av) is a core dependency: wire audio's resampler
    sys.modules[name] = None  # as if not installed: importing it raises ImportError
import deployments.app, deployments.gateway
from deployments import webrtc_routes
from pipeline.adapters.phone.config import carriers_calls, read_phone_section
from pipeline.adapters.phone.twilio_webhook import TwilioWebhook
from pipeline.adapters.webrtc.config import read_webrtc_section
assert webrtc_routes.rtc_peer is None
import asyncio
answer = asyncio.run(webrtc_routes.WebRTCRoutes.realtime_call(None, None))  # refused before it reads anything
assert answer.status_code == 501 and b"webrtc_not_installed" in answer.body, answer.body
assert read_webrtc_section({"max_candidates": 8}).policy.max_candidates == 8
assert carriers_calls(read_phone_section({}), {}) == {}
try:
    TwilioWebhook("token", None, None, 60)
    raise SystemExit("a Twilio webhook without twilio")
except RuntimeError as exc:
    assert "gapless[phone]" in str(exc), exc
print("ok")
"""


def test_the_gateway_starts_without_the_phone_and_webrtc_extras():
    done = subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
