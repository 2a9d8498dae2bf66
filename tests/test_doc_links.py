"""Every relative link in README.md and docs/*.md resolves: the file exists, and an anchor names a
heading of that file as GitHub slugs it (lower case, punctuation dropped, spaces to hyphens, a
repeated heading's slug suffixed -1, -2, ...)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def doc_files(root: Path) -> list[Path]:
    """The markdown pages users read: the front page and docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before de-duplication)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"[^\w\- ]", "", text.lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a page's headings make."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(root: Path) -> list[str]:
    """'page: target (why)' for every relative link or anchor that does not resolve."""
    broken = []
    for page in doc_files(root):
        for line in _prose(page.read_text()):
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                    continue
                file_part, _, anchor = target.partition("#")
                dest = (page.parent / file_part).resolve() if file_part else page
                if not dest.exists():
                    broken.append(f"{page.relative_to(root)}: {target} (no such file)")
                elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                    broken.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return broken


def test_slugs_follow_github():
    assert slug("`serve`: request fields") == "serve-request-fields"
    assert slug("Across Macs: tensor parallel over mx.distributed") == \
        "across-macs-tensor-parallel-over-mxdistributed"
    assert slug("Linux: the BLAS") == "linux-the-blas"


def test_every_relative_link_resolves():
    assert broken_links(ROOT) == []


def _linked_pages(page: Path) -> set[Path]:
    """The markdown files a page links to."""
    targets = (t.partition("#")[0] for line in _prose(page.read_text()) for t in LINK.findall(line))
    return {(page.parent / t).resolve() for t in targets if t.endswith(".md")}


def test_readme_starts_with_the_two_commands_and_lists_every_docs_page():
    """The front page opens with setup-and-run and setup-and-test; its Contents reach docs/."""
    assert (ROOT / "README.md").read_text().splitlines()[:6] == [
        "# batchsim", "", "```", "scripts/setup.sh && .venv/bin/batchsim run",
        "scripts/setup.sh --test && .venv/bin/ruff check && .venv/bin/python -m pytest", "```"]
    unlisted = set(doc_files(ROOT)[1:]) - _linked_pages(ROOT / "README.md")
    assert not unlisted, f"docs pages README.md does not link: {sorted(p.name for p in unlisted)}"


def test_a_broken_link_or_anchor_is_found(tmp_path):
    """In a copy: a link to a missing file, and one to a missing heading, are both reported."""
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    page = tmp_path / "docs" / min(p.name for p in (tmp_path / "docs").glob("*.md"))
    page.write_text(page.read_text() + "\n[gone](missing.md) [nowhere](../README.md#no-such)\n")
    assert sorted(broken_links(tmp_path)) == sorted([
        f"docs/{page.name}: missing.md (no such file)",
        f"docs/{page.name}: ../README.md#no-such (no such heading)"])
