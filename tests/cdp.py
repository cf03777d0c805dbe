"""One headless Chromium tab driven over the DevTools protocol (CDP, the JSON messages of
https://chromedevtools.github.io/devtools-protocol/) with aiohttp's WebSocket client:
navigate, evaluate JavaScript, and record every network request the page makes
(``Network.requestWillBeSent``), for the page tests that must see what a page sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--hide-scrollbars")
_LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


class Tab:
    """A page target: :meth:`send` a CDP command, read its :attr:`requests`."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self._next = 0
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.requests: list[dict[str, Any]] = []  # Network.requestWillBeSent params
        self.console: list[str] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            data = msg.json()
            if "id" in data and data["id"] in self._waiting:
                self._waiting.pop(data["id"]).set_result(data)
            elif data.get("method") == "Network.requestWillBeSent":
                self.requests.append(data["params"])
            elif data.get("method") == "Runtime.consoleAPICalled":
                self.console.append(" ".join(str(a.get("value", a.get("description", "")))
                                             for a in data["params"].get("args", [])))
            elif data.get("method") == "Runtime.exceptionThrown":
                self.console.append(str(data["params"].get("exceptionDetails")))

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Run one CDP command; its ``result``.

        Raises:
            RuntimeError: the browser answered with an error.
        """
        self._next += 1
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[self._next] = fut
        await self.ws.send_json({"id": self._next, "method": method, "params": params})
        answer = await asyncio.wait_for(fut, 60)
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        return dict(answer.get("result", {}))

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = await self.send("Runtime.evaluate", expression=expression,
                                 returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float) -> Any:
        """Poll ``expression`` until it is truthy (one that throws, e.g. before the page
        has the element, counts as falsy); its value.

        Raises:
            TimeoutError: still falsy after ``timeout_s`` (with the page's console).
        """
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                value = await self.evaluate(expression)
            except RuntimeError:
                value = None
            if value:
                return value
            await asyncio.sleep(0.2)
        raise TimeoutError(f"{expression} still falsy after {timeout_s} s; console: "
                           f"{self.console[-10:]}")


@contextlib.asynccontextmanager
async def chromium_tab(chromium: str, profile: Path) -> AsyncIterator[Tab]:
    """A fresh headless Chromium with one blank tab, the Network, Page and Runtime
    domains on; the browser is stopped on exit."""
    proc = subprocess.Popen(
        [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
         "--remote-debugging-port=0", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        browser_ws = None
        end = time.monotonic() + 60
        while browser_ws is None and time.monotonic() < end:
            line = await asyncio.to_thread(proc.stderr.readline)
            if not line and proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {proc.returncode}")
            if m := _LISTENING.search(line):
                browser_ws = m.group(1)
        if browser_ws is None:
            raise RuntimeError("chromium never said where DevTools listens")
        http = "http://" + browser_ws.split("/")[2]
        async with aiohttp.ClientSession() as session:
            targets = await (await session.get(f"{http}/json/list")).json()
            page = next(t for t in targets if t["type"] == "page")
            async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                tab = Tab(ws)
                for domain in ("Network", "Page", "Runtime"):
                    await tab.send(f"{domain}.enable")
                try:
                    yield tab
                finally:
                    tab._reader.cancel()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
