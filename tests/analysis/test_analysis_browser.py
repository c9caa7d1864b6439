"""The HTML report in a real browser: headless Chromium driven over the DevTools protocol.

Dependency-free: Chromium's ``--remote-debugging-pipe`` speaks CDP as NUL-terminated JSON on
file descriptors 3 (commands in) and 4 (events and replies out), so no websocket client is
needed. The test loads the report from file://, fails on any console error, exception or
network request other than the file itself and data: URIs, switches the explorer to another
head through its <select>, checks that the drawn canvas changes, and saves a screenshot.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import queue
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from attnlab.analysis import TokenInfo, build_report, classify_heads, score_heads

CHROMIUM = "/usr/bin/chromium"


def _chromium() -> str:
    """Path to chromium; installs the Debian package when root, else skips with the reason."""
    if os.name != "posix":
        pytest.skip("the DevTools pipe needs POSIX file descriptors 3 and 4")
    found = shutil.which("chromium") or (CHROMIUM if os.path.exists(CHROMIUM) else None)
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("chromium is not installed and apt-get cannot run here (needs root)")
    try:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        deadline = time.monotonic() + 300
        subprocess.run(["apt-get", "update"], check=True, capture_output=True, timeout=300,
                       env=env)
        subprocess.run(["apt-get", "install", "-y", "chromium"], check=True, capture_output=True,
                       timeout=max(1.0, deadline - time.monotonic()), env=env)
    except (subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"chromium is not installed and apt-get install failed: {e}")
    found = shutil.which("chromium")
    if not found:
        pytest.skip("apt-get install chromium finished but no chromium binary was found")
    return found


class CDP:
    """Minimal Chrome DevTools Protocol client over --remote-debugging-pipe."""

    def __init__(self, binary: str, user_dir: Path) -> None:
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()

        def wire_fds() -> None:  # in the child: our pipe ends become fds 3 and 4
            a = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 10)
            b = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self._log = open(user_dir / "chromium.log", "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--no-first-run", "--no-default-browser-check", "--mute-audio",
             f"--user-data-dir={user_dir / 'profile'}", "--remote-debugging-pipe",
             "about:blank"],
            pass_fds=(3, 4), preexec_fn=wire_fds, stdin=subprocess.DEVNULL,
            stdout=self._log, stderr=self._log,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._next = 0
        self._replies: dict[int, dict] = {}
        self._msgs: queue.Queue = queue.Queue()
        self.events: list[dict] = []
        threading.Thread(target=self._reader, daemon=True).start()

    def _reader(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._r, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                self._msgs.put(None)
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                self._msgs.put(json.loads(raw))

    def _pump(self, timeout: float) -> None:
        msg = self._msgs.get(timeout=timeout)
        if msg is None:
            raise RuntimeError("chromium closed the DevTools pipe (see chromium.log)")
        if "id" in msg:
            self._replies[msg["id"]] = msg
        else:
            self.events.append(msg)

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 30.0) -> dict:
        self._next += 1
        msg: dict = {"id": self._next, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while self._next not in self._replies:
            self._pump(max(0.01, deadline - time.monotonic()))
        reply = self._replies.pop(self._next)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def wait_event(self, method: str, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for ev in self.events:
                if ev["method"] == method:
                    return ev
            self._pump(max(0.01, deadline - time.monotonic()))

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
        except (RuntimeError, queue.Empty, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        os.close(self._w)
        self._log.close()


def _report(path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    L, H, n = 3, 4, 12
    maps = (torch.rand(L, 1, H, n, n, generator=g) * 5).softmax(-1)  # [L, b, h, n, n]
    maps[0, 0, 0] = 0.0
    maps[0, 0, 0, :, 0] = 1.0  # layer 0 head 0 vertical
    tokens = ["[CLS]", *(f"tok{i}" for i in range(n - 2)), "[SEP]"]
    info = TokenInfo.from_length(n, tokens=tokens)
    scores = score_heads(maps, [info])
    return build_report(
        path, title="browser test", config={"seed": 0}, metrics={"acc": 0.5},
        plan=[{"layers": [1], "heads": [3], "mechanism": "band(window=2)"}],
        history=[{"step": 1, "epoch": 0, "loss": 0.7}, {"step": 2, "epoch": 0, "loss": 0.6},
                 {"step": 2, "epoch": 0, "eval": {"acc": 0.5}}],
        scores=scores, classes=classify_heads(scores),
        examples=[{"tokens": tokens, "maps": maps[:, 0]},
                  {"tokens": tokens[:6], "maps": maps[:, 0, :, :6, :6]}],
    )


def test_report_in_headless_chromium(tmp_path):
    binary = _chromium()
    report = _report(tmp_path / "report.html")
    url = report.resolve().as_uri()
    cdp = CDP(binary, tmp_path)
    try:
        target = cdp.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        sid = cdp.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        for domain in ("Runtime", "Log", "Network", "Page"):
            cdp.send(f"{domain}.enable", session=sid)
        cdp.send("Page.navigate", {"url": url}, session=sid)
        cdp.wait_event("Page.loadEventFired")

        def js(expr: str):
            res = cdp.send("Runtime.evaluate", {"expression": expr, "returnByValue": True},
                           session=sid)
            assert "exceptionDetails" not in res, res["exceptionDetails"]
            return res["result"].get("value")

        assert js("document.body.dataset.ready") == "1"
        canvas_png = "document.getElementById('attn-canvas').toDataURL()"
        before = js("JSON.stringify(document.getElementById('attn-canvas').dataset)")
        pixels_before = hashlib.sha256(js(canvas_png).encode()).hexdigest()
        assert json.loads(before)["head"] == "0"
        assert int(js("document.getElementById('attn-lines').dataset.lines")) > 0
        assert js("document.querySelectorAll('#class-grid td').length") == 3 * 4
        js("""(() => { const s = document.getElementById('head-select');
                       s.value = '2'; s.dispatchEvent(new Event('change')); })()""")
        after = json.loads(js("JSON.stringify(document.getElementById('attn-canvas').dataset)"))
        assert after["head"] == "2"
        assert after["hash"] != json.loads(before)["hash"]
        assert hashlib.sha256(js(canvas_png).encode()).hexdigest() != pixels_before
        assert "head 2" in js("document.getElementById('head-info').textContent")
        # the example switch redraws with that example's tokens
        js("""(() => { const s = document.getElementById('example-select');
                       s.value = '1'; s.dispatchEvent(new Event('change')); })()""")
        assert js("document.querySelectorAll('#attn-lines text').length") == 2 * 6
        # hovering a query token leaves only that token's lines visible
        visible = """[...document.querySelectorAll('#attn-lines line')]
                     .filter((l) => l.style.display !== 'none').length"""
        total = js(visible)
        js("""document.querySelector('#attn-lines text')
                .dispatchEvent(new MouseEvent('mouseenter'))""")
        assert 0 < js(visible) < total
        # clicking a head in the class grid opens it in the explorer
        js("document.querySelector('#class-grid td[data-layer=\"1\"][data-head=\"3\"]').click()")
        assert js("document.getElementById('attn-canvas').dataset.layer") == "1"
        assert js("document.getElementById('head-select').value") == "3"
        # that head is the one the plan replaced: marked in every grid and in the explorer
        for grid in ("mech-grid", "class-grid", "score-grid"):
            marked = js(f"[...document.querySelectorAll('#{grid} td.replaced')]"
                        ".map((td) => td.dataset.layer + ':' + td.dataset.head).join()")
            assert marked == "1:3", (grid, marked)
        badge = js("document.getElementById('head-mechanism').textContent")
        assert badge == "replaced by the plan: band(window=2)"
        assert "(replaced)" in js("document.getElementById('head-select')"
                                  ".selectedOptions[0].textContent")
        assert js("document.getElementById('training-curves').querySelector('img')"
                  ".naturalWidth") > 300
        shot = cdp.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True},
                        session=sid)
        png = tmp_path / "report.png"
        png.write_bytes(base64.b64decode(shot["data"]))
        assert png.stat().st_size > 1000
        time.sleep(0.2)  # let late console/network events arrive
        while not cdp._msgs.empty():
            cdp._pump(0.1)
    finally:
        cdp.close()
    def is_error(e: dict) -> bool:
        m, p = e["method"], e["params"]
        return (
            m == "Runtime.exceptionThrown"
            or (m == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"))
            or (m == "Log.entryAdded" and p["entry"]["level"] == "error")
        )

    errors = [e["params"] for e in cdp.events if is_error(e)]
    assert not errors, errors
    requests = [
        e["params"]["request"]["url"] for e in cdp.events
        if e["method"] == "Network.requestWillBeSent"
    ]
    assert url in requests  # the network domain did record the page itself
    foreign = [u for u in requests if u != url and not u.startswith("data:")]
    assert not foreign, foreign
