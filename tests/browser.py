"""A real browser for tests: Debian's chromium, headless, driven over the Chrome DevTools
Protocol (its --remote-debugging-port websocket, through aiohttp).

Clicks and typing are input events at the element's place on the page, as a person's are;
dialogs (`confirm`) are answered yes and recorded; script errors and console errors are
recorded for the test to assert on.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM_NAMES = ("chromium", "chromium-browser")
WIDTH, HEIGHT = 1280, 900


class BrowserError(RuntimeError):
    """The browser could not start, or a page call failed."""


def chromium() -> str:
    """The chromium executable; BrowserError naming how to install it when there is none."""
    for name in CHROMIUM_NAMES:
        if found := shutil.which(name):
            return found
    raise BrowserError(
        "the web console's browser test needs Debian's chromium: `make browser-deps` "
        "(as root) or `apt-get install chromium`"
    )


class Page:
    """One tab of the browser, over its DevTools websocket."""

    def __init__(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        self.socket = socket
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.dialogs: list[str] = []
        """Messages of the dialogs the page opened (each accepted)."""
        self.errors: list[str] = []
        """Uncaught script errors and console errors (a CSP refusal is one)."""
        self._reader = asyncio.create_task(self._read(), name="cdp-reader")

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """A DevTools command's result; BrowserError with the browser's message if it fails."""
        call_id = next(self._ids)
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = answer
        await self.socket.send_str(json.dumps({"id": call_id, "method": method, "params": params}))
        reply = await asyncio.wait_for(answer, 60)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    async def _read(self) -> None:
        async for message in self.socket:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(message.data)
            if "id" in data:
                if (answer := self._waiting.pop(data["id"], None)) and not answer.done():
                    answer.set_result(data)
                continue
            await self._on_event(data.get("method", ""), data.get("params", {}))

    async def _on_event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Page.javascriptDialogOpening":
            self.dialogs.append(params.get("message", ""))
            answer = {  # sent without waiting for its reply: the reader must go on
                "id": next(self._ids),
                "method": "Page.handleJavaScriptDialog",
                "params": {"accept": True},
            }
            await self.socket.send_str(json.dumps(answer))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.errors.append(str(details.get("exception", {}).get("description") or details))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            self.errors.append(str(params["entry"].get("text")))
        elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            self.errors.append(json.dumps(params.get("args", []))[:500])

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (a promise awaited)."""
        result = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    async def wait_for(self, expression: str, *, timeout_s: float = 60.0, what: str = "") -> Any:
        """The expression's value once it is truthy, polled; BrowserError after `timeout_s`,
        with what the page showed then."""
        deadline = time.monotonic() + timeout_s
        while not (value := await self.evaluate(expression)):
            if time.monotonic() > deadline:
                shown = await self.evaluate("document.body.innerText")
                raise BrowserError(
                    f"waited {timeout_s:.0f}s for {what or expression}; the page shows:\n"
                    f"{str(shown)[-3000:]}\nerrors: {self.errors}"
                )
            await asyncio.sleep(0.25)
        return value

    async def navigate(self, url: str) -> None:
        await self.call("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'", what=f"{url} to load")

    async def click(self, selector: str) -> None:
        """A left click at the middle of the first element `selector` matches, scrolled into
        view: mouse pressed and released there, as a person clicks."""
        box = await self.wait_for(
            f"""(() => {{
                const found = document.querySelector({json.dumps(selector)});
                if (!found || found.disabled) return null;
                found.scrollIntoView({{block: "center"}});
                const box = found.getBoundingClientRect();
                if (!box.width || !box.height) return null;
                return [box.x + box.width / 2, box.y + box.height / 2];
            }})()""",
            what=f"a clickable {selector}",
        )
        x, y = box
        for kind in ("mousePressed", "mouseReleased"):
            await self.call(
                "Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1
            )

    async def type_into(self, selector: str, text: str) -> None:
        await self.click(selector)
        await self.call("Input.insertText", text=text)

    async def screenshot(self, path: Path, *, full_page: bool = False) -> Path:
        """A PNG of the viewport (`full_page`: of the whole page) written to `path`."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            width, height = await self.evaluate(
                "[document.documentElement.scrollWidth, document.documentElement.scrollHeight]"
            )
            params |= {
                "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1},
            }
        shot = await self.call("Page.captureScreenshot", **params)
        await asyncio.to_thread(_write, path, base64.b64decode(shot["data"]))
        return path

    async def close(self) -> None:
        self._reader.cancel()
        await self.socket.close()


@asynccontextmanager
async def browser_page(profile_dir: Path) -> AsyncIterator[Page]:
    """A headless chromium (its profile in `profile_dir`, its log beside it) and a tab of it
    at 1280x900; the browser is ended when the block is."""
    log = profile_dir.with_name(profile_dir.name + "-chromium.log")
    process = _start_chromium(profile_dir, log)
    try:
        port = await _debugging_port(profile_dir, process, log)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/json/list") as listed:
                targets = await listed.json()
            url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
            async with http.ws_connect(url, max_msg_size=0) as socket:
                page = Page(socket)
                for domain in ("Page", "Runtime", "Log"):
                    await page.call(f"{domain}.enable")
                await page.call(
                    "Emulation.setDeviceMetricsOverride",
                    width=WIDTH,
                    height=HEIGHT,
                    deviceScaleFactor=1,
                    mobile=False,
                )
                try:
                    yield page
                finally:
                    await page.close()
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _start_chromium(profile_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as log_file:
        return subprocess.Popen(
            [
                chromium(),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--hide-scrollbars",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile_dir}",
                f"--window-size={WIDTH},{HEIGHT}",
                "about:blank",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )


async def _debugging_port(profile_dir: Path, process: subprocess.Popen[bytes], log: Path) -> int:
    """The port chromium chose (it writes it to DevToolsActivePort in its profile)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            said = _tail(log)
            raise BrowserError(f"chromium exited {process.returncode}: {said}")
        if (port := _port_written(profile_dir)) is not None:
            return port
        await asyncio.sleep(0.1)
    raise BrowserError("chromium did not open its debugging port within 60 s")


def _port_written(profile_dir: Path) -> int | None:
    active = profile_dir / "DevToolsActivePort"
    lines = active.read_text().splitlines() if active.is_file() else []
    return int(lines[0]) if lines and lines[0].isdigit() else None


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:]


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
