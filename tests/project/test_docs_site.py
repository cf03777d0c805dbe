"""The documentation (issue 38, item 10): a README a newcomer reads in five minutes, the
rest a MkDocs (Material) site under ``docs/`` built here with ``--strict`` (a broken
link, a missing page or a page outside the nav fails the suite), and
``examples/README.md``'s table rendering with every example in it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import markdown
import yaml

from flowlift.testing import free_port

ROOT = Path(__file__).resolve().parents[2]


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, timeout=240, env=env, check=False)


def _nav_files(nav: list) -> list[str]:
    out: list[str] = []
    for entry in nav:
        for value in (entry.values() if isinstance(entry, dict) else [entry]):
            out.extend(_nav_files(value) if isinstance(value, list) else [value])
    return out


def test_the_docs_site_builds_strict_with_every_page(tmp_path):
    built = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0, built.stderr[-4000:]
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["theme"]["name"] == "material"
    pages = _nav_files(config["nav"])
    assert sorted(pages) == sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    # the pages other parts of the project write (placeholders until they land)
    assert {"agents.md", "responses.md", "gpu.md", "distributed.md"} <= set(pages)
    for page in pages:
        html = tmp_path / "site" / ("index.html" if page == "index.md"
                                    else f"{page.removesuffix('.md')}/index.html")
        assert html.is_file(), page


def _copy_site(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    return tmp_path / "mkdocs.yml"


def test_a_broken_link_fails_the_build(tmp_path):
    config = _copy_site(tmp_path)
    with (tmp_path / "docs" / "status.md").open("a") as f:
        f.write("\nSee [the old page](no-such-page.md).\n")
    built = _mkdocs_build(config, tmp_path / "site")
    assert built.returncode != 0 and "no-such-page.md" in built.stderr


def test_a_broken_anchor_and_a_page_outside_the_nav_fail_the_build(tmp_path):
    config = _copy_site(tmp_path)
    with (tmp_path / "docs" / "status.md").open("a") as f:
        f.write("\nSee [runs that grow](workflows.md#no-such-section).\n")
    assert _mkdocs_build(config, tmp_path / "site").returncode != 0
    (tmp_path / "docs" / "status.md").write_text("# Status\n")
    (tmp_path / "docs" / "orphan.md").write_text("# Orphan\n")
    built = _mkdocs_build(config, tmp_path / "site")
    assert built.returncode != 0 and "orphan.md" in built.stderr


def test_the_readme_is_short_with_the_two_commands_and_links_that_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert "\nbash scripts/demo.sh\nbash scripts/test.sh\n" in text
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert "docs/quickstart.md" in targets
    missing = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    assert not missing
    # stale lines of the old README stay gone from the docs
    docs = "\n".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    assert "`POST /v1/embeddings`, `POST /v1/responses` | passed through" not in docs
    assert "converted once into `.cache/flowlift/models/`" not in docs


def test_the_readmes_first_workflow_runs_as_written(tmp_path):
    text = (ROOT / "README.md").read_text()
    code = text.split("## A first workflow", 1)[1].split("```python\n", 1)[1].split("```")[0]
    (tmp_path / "first.py").write_text(code)
    env = {**os.environ, "FLOWLIFT_PROGRESS": "0"}
    out = subprocess.run([sys.executable, "-m", "flowlift.cli", "run", "--engine", "fake",
                          "--base-url", f"http://127.0.0.1:{free_port()}", "first.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=180,
                         env=env, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("echo: Title:"), out.stdout


class _Table(HTMLParser):
    """The rows of the first ``<table>``: each cell's text and the links in it."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[tuple[str, list[str]]]] = []
        self._cell: list[str] | None = None
        self._links: list[str] = []
        self.tables = 0

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables += 1
        elif tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell, self._links = [], []
        elif tag == "a" and self._cell is not None:
            self._links.append(dict(attrs)["href"])

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append(("".join(self._cell).strip(), self._links))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def test_the_examples_table_renders_and_lists_every_example():
    readme = ROOT / "examples" / "README.md"
    table = _Table()
    table.feed(markdown.markdown(readme.read_text(), extensions=["tables"]))
    assert table.tables == 1
    header, *rows = table.rows
    assert [c for c, _ in header] == ["example", "what it shows"]
    assert all(len(r) == 2 and r[1][0] for r in rows), "every row has its two cells"
    listed = {cell for (cell, _), _ in rows}
    scripts = {p.relative_to(readme.parent).as_posix()
               for p in readme.parent.glob("*/*.py") if "__main__" in p.read_text()}
    assert scripts and scripts == listed
    for (_, links), _ in rows:
        assert links and all((readme.parent / link).is_file() for link in links)
