"""Open an HTML file in headless Chromium and report what happened, over the DevTools protocol.

`probe_page(path)` starts /usr/bin/chromium with networking features off and a throw-away
profile, loads the file, and returns a `PageReport`: console messages and exceptions, every
network request the page made, per-chart SVG statistics, a full-page PNG screenshot and a
PDF print. The browser is always stopped before returning.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-default-apps",
    "--disable-extensions",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
)

# Per figure.chart: does it hold an <svg>, how many <path>s with geometry are drawn in it.
CHART_STATS_JS = """
JSON.stringify(Array.from(document.querySelectorAll('figure.chart')).map(fig => {
  const svg = fig.querySelector('svg');
  const paths = svg ? Array.from(svg.querySelectorAll('path')) : [];
  const drawn = paths.filter(p => (p.getAttribute('d') || '').length > 10 &&
                                  p.getBBox().width + p.getBBox().height > 0);
  const box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
  return {title: fig.dataset.chart, has_svg: !!svg, paths: paths.length,
          drawn_paths: drawn.length, width: box.width, height: box.height};
}))
"""


@dataclass
class PageReport:
    """What loading one page did."""

    console: list[dict] = field(default_factory=list)
    exceptions: list[str] = field(default_factory=list)
    log_entries: list[dict] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    charts: list[dict] = field(default_factory=list)
    screenshot_png: bytes = b""
    pdf: bytes = b""
    values: dict = field(default_factory=dict)


class _DevTools:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse, report: PageReport):
        self.ws = ws
        self.report = report
        self.next_id = 0
        self.events: list[dict] = []

    def _record(self, message: dict) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            self.report.console.append({"type": params["type"], "text": text})
        elif method == "Runtime.exceptionThrown":
            self.report.exceptions.append(json.dumps(params["exceptionDetails"])[:500])
        elif method == "Log.entryAdded":
            entry = params["entry"]
            self.report.log_entries.append({"level": entry["level"], "text": entry["text"]})
        elif method == "Network.requestWillBeSent":
            self.report.requests.append(params["request"]["url"])
        self.events.append(message)

    async def call(self, method: str, **params) -> dict:
        self.next_id += 1
        call_id = self.next_id
        await self.ws.send_json({"id": call_id, "method": method, "params": params})
        while True:
            message = await self.ws.receive_json()
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
            self._record(message)

    async def wait_for(self, method: str) -> None:
        while not any(e.get("method") == method for e in self.events):
            self._record(await self.ws.receive_json())


def _devtools_port(profile: Path, process: subprocess.Popen, deadline: float) -> int:
    port_file = profile / "DevToolsActivePort"
    while time.monotonic() < deadline:
        if port_file.is_file() and port_file.read_text().strip():
            return int(port_file.read_text().split()[0])
        if process.poll() is not None:
            raise RuntimeError(f"chromium exited early with code {process.returncode}")
        time.sleep(0.05)
    raise TimeoutError("chromium did not open its DevTools port")


async def _drive(
    port: int, url: str, report: PageReport, width: int, expressions: dict[str, str]
) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
            targets = await response.json()
        page = next(t for t in targets if t["type"] == "page")
        async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            dt = _DevTools(ws, report)
            for domain in ("Runtime", "Log", "Network", "Page"):
                await dt.call(f"{domain}.enable")
            await dt.call(
                "Emulation.setDeviceMetricsOverride",
                width=width, height=900, deviceScaleFactor=1, mobile=False,
            )  # fmt: skip
            await dt.call("Page.navigate", url=url)
            await dt.wait_for("Page.loadEventFired")
            result = await dt.call(
                "Runtime.evaluate", expression=CHART_STATS_JS, returnByValue=True
            )
            report.charts = json.loads(result["result"]["value"])
            for name, expression in expressions.items():
                value = await dt.call("Runtime.evaluate", expression=expression, returnByValue=True)
                report.values[name] = value["result"].get("value")
            metrics = await dt.call("Page.getLayoutMetrics")
            size = metrics["cssContentSize"]
            shot = await dt.call(
                "Page.captureScreenshot",
                format="png",
                captureBeyondViewport=True,
                clip={"x": 0, "y": 0, "width": width, "height": size["height"], "scale": 1},
            )
            report.screenshot_png = base64.b64decode(shot["data"])
            pdf = await dt.call("Page.printToPDF", printBackground=True)
            report.pdf = base64.b64decode(pdf["data"])
            await asyncio.sleep(0.2)  # let late console or network events arrive
            await dt.call("Runtime.evaluate", expression="1")


def probe_page(
    path: Path,
    *,
    timeout_s: float = 90.0,
    width: int = 1366,
    expressions: dict[str, str] | None = None,
) -> PageReport:
    """Load `path` in headless Chromium (a laptop-sized window `width` CSS px wide); the
    JavaScript `expressions` are evaluated after load, their values put in `report.values`."""
    report = PageReport()
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    # Own process group, so the browser's helper processes stop with it.
    process = subprocess.Popen(
        [str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout_s
        port = _devtools_port(Path(profile), process, deadline)
        remaining = max(1.0, deadline - time.monotonic())
        url = Path(path).resolve().as_uri()
        driving = _drive(port, url, report, width, expressions or {})
        asyncio.run(asyncio.wait_for(driving, remaining))
    finally:
        _stop(process)
        shutil.rmtree(profile, ignore_errors=True)
    return report


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM the browser's process group, then SIGKILL it if it lingers."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    # Helpers of the group may outlive the main process by a moment; make sure they go.
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
