"""A small Chrome DevTools Protocol client for tests: headless Chromium, one page.

Chromium is started with a fresh profile directory and a random debugging
port (read back from ``DevToolsActivePort``); commands go over the browser's
websocket with a flattened session for the page.  Every wait is bounded, and
:meth:`Browser.close` always ends the process.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import websocket

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--mute-audio",
]


def chromium_path() -> str | None:
    if os.path.exists(CHROMIUM):
        return CHROMIUM
    return shutil.which("chromium")


class CDPError(RuntimeError):
    pass


class Browser:
    def __init__(self, profile_dir: Path, *, width: int = 1200, height: int = 800, timeout: float = 30.0) -> None:
        exe = chromium_path()
        if exe is None:
            raise CDPError("chromium not installed")
        self.timeout = timeout
        profile_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [exe, *FLAGS, f"--user-data-dir={profile_dir}", "--remote-debugging-port=0",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.events: list[dict[str, Any]] = []
        self._id = 0
        self.ws: websocket.WebSocket | None = None
        try:
            port_file = profile_dir / "DevToolsActivePort"
            deadline = time.monotonic() + timeout
            while not port_file.exists() or len(port_file.read_text().splitlines()) < 2:
                if self.proc.poll() is not None:
                    raise CDPError(f"chromium exited with {self.proc.returncode}")
                if time.monotonic() > deadline:
                    raise CDPError("chromium did not open its debugging port")
                time.sleep(0.05)
            port, path = port_file.read_text().splitlines()[:2]
            self.ws = websocket.create_connection(f"ws://127.0.0.1:{port}{path}", timeout=timeout, suppress_origin=True)
            target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
            self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            self.send("Page.enable", session=True)
            self.send("Runtime.enable", session=True)
            self.send("Emulation.setDeviceMetricsOverride",
                      {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session=True)
        except BaseException:
            self.close()
            raise

    # -- protocol ---------------------------------------------------------
    def send(self, method: str, params: dict[str, Any] | None = None, *, session: bool = False) -> dict[str, Any]:
        assert self.ws is not None
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise CDPError(f"{method}: {reply['error']}")
                return reply.get("result", {})  # type: ignore[no-any-return]
            self.events.append(reply)
        raise CDPError(f"{method}: no reply within {self.timeout}s")

    def send_nowait(self, method: str, params: dict[str, Any] | None = None, *, session: bool = False) -> int:
        """Send without waiting: for input that opens a dialog, whose reply only comes after it."""
        assert self.ws is not None
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        self.ws.send(json.dumps(msg))
        return self._id

    def answer_prompt(self, text: str | None) -> dict[str, Any]:
        """Wait for a JavaScript dialog and accept it with ``text`` (``None``: cancel)."""
        ev = self.wait_event("Page.javascriptDialogOpening")
        params: dict[str, Any] = {"accept": text is not None}
        if text is not None:
            params["promptText"] = text
        self.send("Page.handleJavaScriptDialog", params, session=True)
        return ev

    def click_nowait(self, x: float, y: float) -> None:
        self.mouse("mouseMoved", x, y)
        self.mouse("mousePressed", x, y, 1)
        self.send_nowait("Input.dispatchMouseEvent",
                         {"type": "mouseReleased", "x": x, "y": y, "button": "left", "clickCount": 1}, session=True)

    def wait_event(self, method: str, timeout: float | None = None) -> dict[str, Any]:
        """The first pending or next event named ``method`` (consumed)."""
        assert self.ws is not None
        for i, ev in enumerate(self.events):
            if ev.get("method") == method:
                return self.events.pop(i)
        deadline = time.monotonic() + (timeout or self.timeout)
        while time.monotonic() < deadline:
            self.ws.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                ev = json.loads(self.ws.recv())
            except websocket.WebSocketTimeoutException:
                break
            finally:
                self.ws.settimeout(self.timeout)
            if ev.get("method") == method:
                return ev  # type: ignore[no-any-return]
            self.events.append(ev)
        raise CDPError(f"no {method} event")

    # -- page helpers -----------------------------------------------------
    def navigate(self, url: str) -> None:
        self.events = [e for e in self.events if e.get("method") != "Page.loadEventFired"]
        self.send("Page.navigate", {"url": url}, session=True)
        self.wait_event("Page.loadEventFired")

    def eval(self, expression: str) -> Any:
        r = self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            session=True,
        )
        if "exceptionDetails" in r:
            raise CDPError(f"{expression!r}: {r['exceptionDetails'].get('text')} {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 20.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = self.eval(expression)
            if v:
                return v
            time.sleep(0.1)
        raise CDPError(f"timed out waiting for {expression!r}")

    def mouse(self, kind: str, x: float, y: float, clicks: int = 0) -> None:
        params: dict[str, Any] = {"type": kind, "x": x, "y": y}
        if kind in ("mousePressed", "mouseReleased"):
            params.update(button="left", clickCount=clicks or 1)
        self.send("Input.dispatchMouseEvent", params, session=True)

    def click(self, x: float, y: float) -> None:
        self.mouse("mouseMoved", x, y)
        self.mouse("mousePressed", x, y, 1)
        self.mouse("mouseReleased", x, y, 1)

    def key(self, key: str, code: int) -> None:
        for kind in ("keyDown", "keyUp"):
            self.send("Input.dispatchKeyEvent",
                      {"type": kind, "key": key, "windowsVirtualKeyCode": code, "nativeVirtualKeyCode": code},
                      session=True)

    def screenshot(self, path: Path) -> None:
        data = self.send("Page.captureScreenshot", {"format": "png"}, session=True)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            if self.ws is not None:
                try:
                    self.send("Browser.close")
                except Exception:
                    pass
                self.ws.close()
        finally:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
