"""The README and docs/: every relative link lands, the README stays one screenful, the CLI reference is current,
and every page is reachable from the README.

Links are read from the markdown source outside code (fenced blocks and inline code spans are skipped); absolute
``http(s)`` links and ``mailto:`` are not checked (no network). An ``#anchor`` must be the GitHub-style slug of a
heading in the target file.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose_lines(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def links(path: Path) -> list[str]:
    """Every link target in the file's prose, inline code removed."""
    return [m.group(1) for line in prose_lines(path) for m in LINK.finditer(CODE_SPAN.sub("", line))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = CODE_SPAN.sub(lambda m: m.group(2), text).replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors a file's headings produce (a repeated slug gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(
                f"{target}: no such file {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved}"
            )
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading in {resolved.name} makes the anchor #{anchor}")
        elif anchor and resolved.suffix != ".md":
            broken.append(f"{target}: an anchor into a file that is not markdown")
    return broken


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_lands(path: Path) -> None:
    assert broken_links(path) == []


def test_readme_is_one_screenful_of_purpose() -> None:
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move the depth into a page under docs/"


def _cli_reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cli_reference", DOCS / "cli_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_current() -> None:
    generated = _cli_reference().render()
    assert (DOCS / "cli.md").read_text(encoding="utf-8") == generated, (
        "docs/cli.md is stale: run python docs/cli_reference.py"
    )


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in links(README)}
    unlinked = [page.name for page in sorted(DOCS.glob("*.md")) if page.resolve() not in linked]
    assert unlinked == [], f"docs pages the README does not link to: {unlinked}"


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Prove it: `bigbatch verify`", "prove-it-bigbatch-verify"),
        ("Install, with optional extras", "install-with-optional-extras"),
        ("bigbatch critical-batch", "bigbatch-critical-batch"),
        ("Many processes, many machines", "many-processes-many-machines"),
        ("The `--data` cache (v2)", "the---data-cache-v2"),
    ],
)
def test_slug_follows_github(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_a_dead_link_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n[ok](page.md#title) [gone](missing.md) [bad anchor](page.md#nowhere) [web](https://example.com)\n"
        "`[in code](missing.md)`\n\n```\n[fenced](missing.md)\n# not a heading\n```\n",
        encoding="utf-8",
    )
    assert anchors(page) == {"title"}
    assert [target.split(":")[0] for target in broken_links(page)] == ["missing.md", "page.md#nowhere"]
