"""A minimal W3C WebDriver client (urllib only) driving Debian's chromium via chromedriver.

Only what the report's browser tests need: open a page, run a script, find elements,
click, hover, type, read the browser console, take a screenshot. No third-party
package: Selenium's dependency pins drift against ours.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ELEMENT = "element-6066-11e4-a52e-4f735466cecf"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
]


class WebDriverError(RuntimeError):
    pass


def find_browser() -> tuple[str, str] | None:
    """``(chromium, chromedriver)`` paths, or None when either is missing."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Browser:
    """One chromedriver process and one headless chromium session."""

    def __init__(self, browser: str, driver: str, width: int = 1400, height: int = 1000):
        self.port = _free_port()
        self.profile = tempfile.mkdtemp(prefix="cw-chromium-")
        self.proc = subprocess.Popen(
            [driver, f"--port={self.port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 20
        while True:
            try:
                if self._call("GET", "/status")["ready"]:
                    break
            except (OSError, WebDriverError):
                pass
            if time.time() > deadline:
                self.proc.kill()
                raise WebDriverError("chromedriver did not start within 20 s")
            time.sleep(0.1)
        caps = {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": browser,
                "args": [*CHROMIUM_ARGS, f"--user-data-dir={self.profile}"],
            },
            "goog:loggingPrefs": {"browser": "ALL"},
        }
        try:
            value = self._call("POST", "/session", {"capabilities": {"alwaysMatch": caps}})
        except Exception:
            self.proc.kill()
            raise
        self.session = f"/session/{value['sessionId']}"
        self.cmd("POST", "/window/rect", {"width": width, "height": height})

    # ---- protocol ------------------------------------------------------------------
    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body if body is not None else {}).encode() if method == "POST" else None
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return json.loads(resp.read() or b"null")["value"]
        except urllib.error.HTTPError as err:
            detail = json.loads(err.read() or b"{}").get("value", {})
            raise WebDriverError(f"{method} {path}: {detail.get('message', err)}") from None

    def cmd(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        return self._call(method, self.session + path, body)

    # ---- helpers -------------------------------------------------------------------
    def open(self, path: Path) -> None:
        self.cmd("POST", "/url", {"url": path.resolve().as_uri()})

    def js(self, script: str, *args: Any) -> Any:
        return self.cmd("POST", "/execute/sync", {"script": script, "args": list(args)})

    def find(self, css: str) -> str:
        return str(self.cmd("POST", "/element", {"using": "css selector", "value": css})[ELEMENT])

    def click(self, css: str) -> None:
        self.cmd("POST", f"/element/{self.find(css)}/click")

    def hover(self, css: str) -> None:
        move = {
            "type": "pointerMove",
            "duration": 0,
            "origin": {ELEMENT: self.find(css)},
            "x": 0,
            "y": 0,
        }
        pointer = {"type": "pointer", "id": "mouse", "parameters": {"pointerType": "mouse"}}
        self.cmd("POST", "/actions", {"actions": [{**pointer, "actions": [move]}]})

    def type(self, css: str, text: str) -> None:
        self.cmd("POST", f"/element/{self.find(css)}/value", {"text": text})

    def select(self, css: str, value: str) -> None:
        self.click(f'{css} option[value="{value}"]')

    def wait(self, script: str, timeout: float = 20.0) -> Any:
        """Poll a JS expression until it is truthy; returns its value."""
        deadline = time.time() + timeout
        while True:
            value = self.js(f"return ({script});")
            if value:
                return value
            if time.time() > deadline:
                raise WebDriverError(f"timed out waiting for: {script}")
            time.sleep(0.05)

    def console(self) -> list[dict[str, Any]]:
        """Browser console entries since the last call (chromedriver's log endpoint)."""
        return list(self.cmd("POST", "/se/log", {"type": "browser"}))

    def screenshot(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.cmd("GET", "/screenshot")))
        return path

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.cmd("DELETE", "")
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)
