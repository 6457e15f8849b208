"""The HTML report is one self-contained page that renders in headless Chromium."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from enginetap.tap.analysis.report import analyse, html_page

from .conftest import Recorder, requests

PROMPTS = ["the cache holds every key", "kernels and caches", "the cache holds every key"]


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.sources: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.sources += [v or "" for k, v in attrs if k in ("src", "href")]


@pytest.fixture
def page(record: Recorder, tmp_path: Path) -> Path:
    _, run = record("qwen3_moe", requests(PROMPTS, max_new_tokens=3))
    path = tmp_path / "report.html"
    path.write_text(html_page(analyse(run)), encoding="utf-8")
    return path


def test_the_page_is_self_contained_with_grid_and_tables(page: Path) -> None:
    tags = _Tags()
    tags.feed(page.read_text(encoding="utf-8"))
    assert tags.sources == []  # nothing fetched
    assert tags.tags.count("table") >= 1 and "script" in tags.tags
    text = page.read_text(encoding="utf-8")
    assert "Where pairs split" in text and "<th>L1</th>" in text
    # the pairs are counted (a table of splits lists classes of requests, when any split)
    assert re.search(r"Same-prefix splits \([1-9]\d* row pairs compared", text)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed")
def test_the_page_renders_in_headless_chromium_without_script_errors(page: Path) -> None:
    done = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu",
                           "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'data-rendered="yes"' in done.stdout  # the inline script ran to its end
    assert "Where pairs split" in done.stdout
    assert "Uncaught" not in done.stderr
