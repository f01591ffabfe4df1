"""Every link and repository path in the user docs points at something that exists.

Checked in README.md, docs/*.md and native/README.md:
- markdown links `[text](target)` that are not URLs: the target, relative to the page, is a file
  or folder of the repository, and a `#anchor` is a heading of the page it names;
- repository paths written out (`benchmarks/results/latency-h200.json`, docs/parity.md): any
  path that starts with one of the repository's top-level folders, read from the repository root,
  exists. Build outputs (build/, native/target/) are not in the repository and are skipped.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "native" / "README.md"]
TOP_FOLDERS = ("benchmarks", "docs", "manifests", "native", "parity", "tests", "valen_export", "valen_runtime")
BUILD_OUTPUTS = ("native/target/",)

LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"(?<![\w./$-])((?:" + "|".join(TOP_FOLDERS) + r")/[\w./-]*[\w/])")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lowercase, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for title in HEADING.findall(FENCE.sub("", page.read_text())):
        text = re.sub(r"`|\*\*|__|\[([^\]]*)\]\([^)]*\)", r"\1", title).lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def dead_links(page: Path) -> list[str]:
    text = page.read_text()
    prose = FENCE.sub("", text)
    problems = []
    for target in LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{page.relative_to(ROOT)}: link ({target}): {path} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{page.relative_to(ROOT)}: link ({target}): no heading #{anchor} in {dest.relative_to(ROOT)}")
    for path in REPO_PATH.findall(LINK.sub("", text)):  # link targets were checked above
        if path.startswith(BUILD_OUTPUTS):
            continue
        if not (ROOT / path).exists():
            problems.append(f"{page.relative_to(ROOT)}: {path} does not exist")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_paths_resolve(page):
    assert dead_links(page) == []


def test_a_dead_link_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("# A heading\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/there.md#a-heading) [gone](docs/gone.md) [bad anchor](docs/there.md#nope)\n"
        "raw: `benchmarks/results/none.json`; see docs/there.md.\n"
        "[web](https://example.com) `native/target/release/x`\n"
    )
    assert dead_links(page) == [
        "README.md: link (docs/gone.md): docs/gone.md does not exist",
        "README.md: link (docs/there.md#nope): no heading #nope in docs/there.md",
        "README.md: benchmarks/results/none.json does not exist",
    ]
