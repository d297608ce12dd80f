"""The README and the pages under docs/ link to files and headings that exist, and no page is orphaned.

Reads the repository's Markdown only; no network. A link is checked when it is relative (no URL scheme):
its file must exist, and its ``#anchor`` must be the GitHub-style slug of a heading in the target page.
Links inside fenced code blocks and inline code are not links.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text lowercased, punctuation dropped, spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a Markdown page, with GitHub's -1, -2 suffixes for repeated headings."""
    seen: dict[str, int] = {}
    result = set()
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def links(page: Path) -> list[str]:
    """The link targets of a Markdown page, outside code."""
    found = []
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        found.extend(LINK.findall(INLINE_CODE.sub("", line)))
    return found


def broken_links(pages: list[Path]) -> list[str]:
    """One line per relative link whose file or heading does not exist: ``page: target (why)``."""
    problems = []
    for page in pages:
        for target in links(page):
            if SCHEME.match(target):
                continue
            path_part, _, anchor = target.partition("#")
            resolved = (page.parent / path_part).resolve() if path_part else page
            name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
            if not resolved.exists():
                problems.append(f"{name}: {target} (no file {path_part})")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                problems.append(f"{name}: {target} (no heading with anchor #{anchor} in {resolved.name})")
    return problems


def orphans(readme: Path, docs: list[Path]) -> list[str]:
    """The docs pages that neither the README nor another docs page links to."""
    linked = set()
    for page in [readme, *docs]:
        for target in links(page):
            path_part = target.partition("#")[0]
            if path_part and not SCHEME.match(target):
                resolved = (page.parent / path_part).resolve()
                if resolved != page.resolve():
                    linked.add(resolved)
    return [doc.name for doc in docs if doc.resolve() not in linked]


def _repository_pages() -> tuple[Path, list[Path]]:
    readme = ROOT / "README.md"
    docs = sorted((ROOT / "docs").glob("*.md"))
    assert readme.is_file(), f"{readme} is missing"
    assert docs, f"no Markdown page under {ROOT / 'docs'}"
    return readme, docs


def test_every_relative_link_points_to_an_existing_file_and_heading() -> None:
    """The README, docs/ and the design notes beside the packages (``eagle3_pipeline/*/DESIGN.md``)."""
    readme, docs = _repository_pages()
    designs = sorted((ROOT / "eagle3_pipeline").glob("*/DESIGN.md"))
    checked = sum(len(links(page)) for page in [readme, *docs, *designs])
    assert checked > 0, "found no link at all in README.md and docs/: the link parser saw nothing"
    assert designs, "found no DESIGN.md beside a package"
    assert broken_links([readme, *docs, *designs]) == []


def test_every_docs_page_is_linked_from_the_readme_or_another_page() -> None:
    readme, docs = _repository_pages()
    assert orphans(readme, docs) == []


def test_the_checker_reports_missing_files_anchors_and_orphans(tmp_path: Path) -> None:
    """The checks above would see a broken link: run them on a small tree with one of each fault."""
    (tmp_path / "docs").mkdir()
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Top\n\n"
        "[ok](docs/a.md#set-up-python--311) [missing](docs/nope.md) [bad anchor](docs/a.md#nowhere)\n"
        "[self](#top) [web](https://example.com/x.md) `[in code](docs/ghost.md)`\n"
        "```\n[fenced](docs/ghost.md)\n```\n",
        encoding="utf-8",
    )
    page_a = tmp_path / "docs" / "a.md"
    page_a.write_text(
        "# A\n\n## Set-up (Python ≥ 3.11)\n\n## `τ` again\n\n## `τ` again\n\n[b](b.md#τ-again-1)\n", encoding="utf-8"
    )
    page_b = tmp_path / "docs" / "b.md"
    page_b.write_text("# B\n\n## τ again\n\n[back](a.md#τ-again-1) [self](b.md)\n", encoding="utf-8")
    orphan = tmp_path / "docs" / "c.md"
    orphan.write_text("# C\n\n[a](a.md)\n", encoding="utf-8")

    problems = broken_links([readme, page_a, page_b, orphan])

    assert problems == [
        f"{readme}: docs/nope.md (no file docs/nope.md)",
        f"{readme}: docs/a.md#nowhere (no heading with anchor #nowhere in a.md)",
        f"{page_a}: b.md#τ-again-1 (no heading with anchor #τ-again-1 in b.md)",
    ]
    assert orphans(readme, [page_a, page_b, orphan]) == ["c.md"]
    assert anchors(page_a) == {"a", "set-up-python--311", "τ-again", "τ-again-1"}
