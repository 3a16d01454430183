"""Look at a ``zoo compare`` experiment in TensorBoard as a user would: start TensorBoard on it, open its
Custom Scalars and HParams pages in headless Chromium, and save screenshots.

    python -m tools.tensorboard_screenshot runs/majority-1024 --out runs/majority-1024/screenshots

Needs the ``chromium`` binary (Debian: ``apt-get install chromium``); ``tests/experiments/test_tensorboard_page.py``
runs this on a tiny experiment where Chromium is installed and skips where it is not. The screenshots
are PNG files; a page that fails to load leaves an almost blank one, which the test catches by checking
that the image has some variety of pixel values and that TensorBoard served the layout over HTTP.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PAGES = {"custom_scalars": "#custom_scalars", "hparams": "#hparams", "scalars": "#timeseries"}
CHROMIUM = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    return next((path for name in CHROMIUM if (path := shutil.which(name))), None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_tensorboard(logdir: Path, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--port", str(port),
               "--host", "127.0.0.1", "--reload_interval", "0"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=2).read()
            return process
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"tensorboard exited: {process.stderr.read().decode()[-500:]}") from None
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"tensorboard did not answer on port {port} within 60 s")


def served_layout(port: int) -> dict:
    """The Custom Scalars layout TensorBoard serves (what its page draws from)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/custom_scalars/layout", timeout=10) as answer:
        return json.loads(answer.read())


def screenshot(chromium: str, url: str, path: Path, wait_ms: int = 8000) -> None:
    with tempfile.TemporaryDirectory() as profile:
        command = [
            chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", "--window-size=1400,1000", f"--virtual-time-budget={wait_ms}",
            f"--screenshot={path}", url,
        ]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True, timeout=120)


def capture(experiment: Path, out: Path) -> dict[str, Path]:
    chromium = find_chromium()
    if chromium is None:
        raise RuntimeError("no chromium binary found (Debian: apt-get install chromium)")
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = start_tensorboard(experiment, port)
    try:
        layout = served_layout(port)
        (out / "layout.json").write_text(json.dumps(layout, indent=2))
        shots = {}
        for name, anchor in PAGES.items():
            path = out / f"{name}.png"
            screenshot(chromium, f"http://127.0.0.1:{port}/{anchor}", path)
            shots[name] = path
        return shots
    finally:
        server.terminate()
        server.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment", type=Path, help="a zoo compare experiment folder")
    parser.add_argument("--out", type=Path, default=None, help="where the PNGs go (default: <experiment>/screenshots)")
    args = parser.parse_args(argv)
    shots = capture(args.experiment, args.out or args.experiment / "screenshots")
    for name, path in shots.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
