"""The timeline and compile pages in a real browser: headless Chromium (Debian's
``chromium``, installed by ``scripts/install.sh --test``) against a proxy on a
FakeEngine on a real port, after a small workflow ran to its end.

Skipped only when no Chromium is on PATH; ``scripts/test.sh`` (CI) sets
``FLOWLIFT_REQUIRE_CHROMIUM=1`` and then a missing browser is a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from flowlift import step, tool, workflow
from flowlift.testing import running_proxy

CHROMIUM = next((p for n in ("chromium", "chromium-browser", "google-chrome")
                 if (p := shutil.which(n))), None)
if CHROMIUM is None and os.environ.get("FLOWLIFT_REQUIRE_CHROMIUM") == "1":
    raise RuntimeError("FLOWLIFT_REQUIRE_CHROMIUM=1 but no chromium on PATH: run "
                       "`bash scripts/install.sh --test` (it apt-get installs chromium)")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (`bash scripts/install.sh --test` installs "
    "Debian's chromium package; CI requires it)")

WINDOW = (1500, 1000)
EVIL = '<img src=x onerror="document.title=1">'


@step(max_tokens=12)
def extract(doc):
    return f"Facts of {doc} in a few words"


@tool
def related(facts):
    time.sleep(0.3)
    return [EVIL, "zlib"]


@step(max_tokens=40)
def summarize(facts, rel):
    return f"Summarize {facts} with {rel} into one long sentence for the reader"


@step(max_tokens=2)
def side(x):
    return f"side {x}"


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess[str]:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--no-default-browser-check", "--disable-extensions",
           "--disable-background-networking", "--hide-scrollbars",
           f"--user-data-dir={profile}", f"--window-size={WINDOW[0]},{WINDOW[1]}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


class Dom(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.bars: list[dict[str, str | None]] = []
        self.tags: list[str] = []
        self.report_rows: list[dict[str, str | None]] = []
        self.plan_bars: list[dict[str, str | None]] = []
        self.attrs: dict[str, dict[str, str | None]] = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        if a.get("id"):
            self.attrs[a["id"]] = a
        if tag == "rect" and "bar" in (a.get("class") or "").split():
            self.bars.append(a)
        if tag == "tr" and a.get("data-step"):
            self.report_rows.append(a)
        if tag == "rect" and "plan-bar" in (a.get("class") or "").split():
            self.plan_bars.append(a)


def dump(url: str, profile: Path) -> Dom:
    out = chromium("--virtual-time-budget=5000", "--dump-dom", url, profile=profile)
    assert out.returncode == 0, out.stderr[-2000:]
    dom = Dom()
    dom.feed(out.stdout)
    return dom


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    log = tmp_path_factory.mktemp("ui") / "proxy.log"
    with running_proxy("--engine", "fake", "--state-db", ":memory:", "--fake-delay-s", "0.02",
                       log_path=log, ready_timeout_s=60) as (base, _):
        yield base


def test_timeline_page_in_chromium(proxy, tmp_path):
    with workflow("chromium check", base_url=proxy) as wf:
        facts = extract("a document")
        summarize(facts, related(facts))
        side("y")
    doc = httpx.get(f"{proxy}/v1/workflows/{wf.run_id}").json()
    assert doc["report"]["critical_path"] == ["extract_1", "related_1", "summarize_1"]
    url = f"{proxy}/ui/workflows/{wf.run_id}"

    shot = tmp_path / "timeline.png"
    out = chromium(f"--screenshot={shot}", url, profile=tmp_path / "profile")
    assert out.returncode == 0 and shot.is_file(), out.stderr[-2000:]
    assert shot.stat().st_size > 20_000
    from PIL import Image

    with Image.open(shot) as img:
        assert img.size == WINDOW
        rgb = img.convert("RGB")
        colours = rgb.getcolors(maxcolors=1 << 20) or []
    count = {c: n for n, c in colours}
    assert len(count) > 50  # text, bars, bands: not a blank or error page
    assert count.get((255, 240, 227), 0) > 10_000  # the critical rows' band (3 rows)
    # each legend swatch is 12 x 12 = 144 px: more than that is bars
    for stage_rgb, least in (((78, 121, 167), 150), ((89, 161, 79), 1000),  # prefill, decode
                             ((176, 122, 161), 1000)):  # tool wait
        assert count.get(stage_rgb, 0) > least, stage_rgb

    dom = dump(url, tmp_path / "profile")
    critical = {b["data-step"] for b in dom.bars if b.get("data-critical") == "measured"}
    assert critical == {"extract_1", "related_1", "summarize_1"}
    assert {b["data-step"] for b in dom.bars} == {"extract_1", "related_1", "summarize_1",
                                                  "side_1"}
    assert {b["data-stage"] for b in dom.bars} >= {"prefill", "decode", "tool_wait"}
    assert "img" not in dom.tags  # the tool's output was markup: shown as text
    rows = {r["data-step"]: r for r in dom.report_rows}  # drawn by report.js
    assert set(rows) == {"extract_1", "related_1", "summarize_1", "side_1"}
    assert {s for s, r in rows.items() if r.get("class") == "critical"} == critical


def test_compile_page_in_chromium(proxy, tmp_path):
    dom = dump(f"{proxy}/ui/compile", tmp_path / "profile")
    assert dom.attrs["report"].get("data-compiled") == "1", "the report was not drawn"
    rows = {r["data-step"]: r for r in dom.report_rows}
    assert set(rows) == {"doc", "facts", "title", "summary"}
    assert rows["summary"].get("class") == "critical"
    planned = {b["data-step"]: b for b in dom.plan_bars}  # the planned schedule's chart
    assert set(planned) == {"facts", "title", "summary"}
    assert {s for s, b in planned.items() if b.get("data-critical") == "planned"} == {
        "facts", "summary"}
    assert float(planned["summary"]["x"]) > float(planned["facts"]["x"])


def test_missing_run_in_chromium(proxy, tmp_path):
    out = chromium("--dump-dom", f"{proxy}/ui/workflows/wf-missing", profile=tmp_path / "p")
    assert "No such run" in out.stdout and "wf-missing" in out.stdout
