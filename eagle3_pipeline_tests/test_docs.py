"""The README and the pages under docs/ link to files and headings that exist, cite tests, benchmarks,
modules and commands that exist, and hold pipeline-file examples that load; no page is orphaned.

Reads the repository's Markdown only; no network. A link is checked when it is relative (no URL scheme):
its file must exist, and its ``#anchor`` must be the GitHub-style slug of a heading in the target page.
Links inside fenced code blocks and inline code are not links. A citation is a repository path
(``eagle3_pipeline_tests/…``, ``benchmarks/…``, ``eagle3_pipeline/…``, ``tools/…``, ``deploy/…``, with an
optional ``::test_name``), a ``python -m MODULE`` or an ``eagle3-pipeline SUBCOMMAND`` in code.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

from eagle3_pipeline.cli import build_parser
from eagle3_pipeline.config import load_config

ROOT = Path(__file__).resolve().parent.parent
TESTS_FOLDER = Path(__file__).resolve().parent.name

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _lines(text: str) -> list[tuple[bool, str]]:
    """Each line but the fences themselves, with whether it lies inside a fenced code block."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        lines.append((fenced, line))
    return lines


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    return [line for fenced, line in _lines(text) if not fenced]


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


# A repository path as the docs cite it: a top folder of the repository, then path characters, or a test
# module's path inside eagle3_pipeline_tests/ (``drafter/test_export.py``); a trailing ``::name`` names a
# test function in that file. Globs, ellipses and placeholders end the path.
CITED_PATH = re.compile(
    r"(?<![\w/.-])((?:eagle3_pipeline_tests|eagle3_pipeline|benchmarks|tools|deploy)/[\w./-]*|(?:\w+/)+test_\w+\.py)"
    r"(?:::(\w+))?"
)
PYTHON_MODULE = re.compile(r"\bpython3? -m ([\w.]+)")
# The command where a shell line starts one (a log line that mentions the name is not a command).
SUBCOMMAND = re.compile(r"(?:^|&&|;|\|)\s*(?:[\w./-]*/)?eagle3-pipeline +([a-z][a-z-]*)(?: +([a-z][a-z|-]*))?")
# Modules of the serving engines, which run in their own environment on the GPU host, not in this one.
ENGINE_MODULES = {"sglang", "vllm"}


def _code(text: str) -> list[str]:
    """The code of a Markdown page: every fenced block's lines and every inline code span."""
    found: list[str] = []
    for fenced, line in _lines(text):
        found.extend([line] if fenced else (span.strip("`") for span in INLINE_CODE.findall(line)))
    return found


def _defines(source: Path, name: str) -> bool:
    return re.search(rf"^\s*(?:async\s+)?def {re.escape(name)}\b", source.read_text(encoding="utf-8"), re.M) is not None


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser | None]:
    """The words a parser takes first: its subcommands, or the choices of its first positional argument."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
        if not action.option_strings and action.choices is not None:
            return dict.fromkeys(action.choices)
    return {}


def bad_citations(pages: list[Path], root: Path = ROOT) -> list[str]:
    """One line per cited path, module or subcommand that does not exist: ``page: citation (why)``."""
    commands = _subcommands(build_parser())
    problems = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        name = page.relative_to(root) if page.is_relative_to(root) else page
        for cited, test in dict.fromkeys(CITED_PATH.findall(text)):
            cited = cited.rstrip(".")
            target = next((t for t in (root / cited, root / TESTS_FOLDER / cited) if t.exists()), root / cited)
            if not target.exists():
                problems.append(f"{name}: {cited} (no such file or folder)")
            elif test and not (target.is_file() and _defines(target, test)):
                problems.append(f"{name}: {cited}::{test} (no function {test} in {cited})")
        for code in _code(text):
            for module in PYTHON_MODULE.findall(code):
                module = module.rstrip(".")
                if module.split(".")[0] in ENGINE_MODULES:
                    continue
                try:
                    found = importlib.util.find_spec(module) is not None
                except ModuleNotFoundError:
                    found = False
                if not found:
                    problems.append(f"{name}: python -m {module} (no such module here)")
            for command, sub in SUBCOMMAND.findall(code):
                if command not in commands:
                    problems.append(f"{name}: eagle3-pipeline {command} (not a subcommand)")
                    continue
                parser = commands[command]
                nested = _subcommands(parser) if parser is not None else {}
                for word in sub.split("|") if nested and sub else []:
                    if word not in nested:
                        problems.append(f"{name}: eagle3-pipeline {command} {word} (not a subcommand of {command})")
    return problems


def test_every_cited_test_benchmark_module_and_command_exists() -> None:
    readme, docs = _repository_pages()
    assert bad_citations([readme, *docs]) == []


def test_the_citation_check_reports_what_does_not_exist(tmp_path: Path) -> None:
    """A page citing one real and one invented thing of each kind: only the invented ones are reported."""
    page = tmp_path / "page.md"
    page.write_text(
        "Measured by `eagle3_pipeline_tests/test_docs.py::test_the_citation_check_reports_what_does_not_exist`\n"
        "and `eagle3_pipeline_tests/drafter/test_invented.py`, `benchmarks/invented.py`,\n"
        "eagle3_pipeline_tests/test_docs.py::test_invented in prose, `tools/vllm-cpu/build.sh`,\n"
        "`drafter/train/test_ttt_memory.py` and `drafter/test_invented_memory.py` in eagle3_pipeline_tests/.\n\n"
        "```bash\n"
        ".venv/bin/python -m benchmarks.drafter_train --memory\n"
        ".venv/bin/python -m benchmarks.invented\n"
        "python -m sglang.launch_server --model-path /models/x\n"
        "eagle3-pipeline plan --config x.yaml && eagle3-pipeline replan\n"
        "eagle3-pipeline server status|restart\n"
        "=== 12:00 eagle3-pipeline starts the generation server\n"
        "```\n",
        encoding="utf-8",
    )

    assert bad_citations([page], root=ROOT) == [
        f"{page}: eagle3_pipeline_tests/drafter/test_invented.py (no such file or folder)",
        f"{page}: benchmarks/invented.py (no such file or folder)",
        f"{page}: eagle3_pipeline_tests/test_docs.py::test_invented (no function test_invented in "
        "eagle3_pipeline_tests/test_docs.py)",
        f"{page}: drafter/test_invented_memory.py (no such file or folder)",
        f"{page}: python -m benchmarks.invented (no such module here)",
        f"{page}: eagle3-pipeline replan (not a subcommand)",
        f"{page}: eagle3-pipeline server restart (not a subcommand of server)",
    ]


def pipeline_examples(page: Path) -> list[str]:
    """The fenced ``yaml`` blocks of a page that are a whole pipeline file (a ``name:`` and ``datasets:``)."""
    blocks, current = [], None
    for line in page.read_text(encoding="utf-8").splitlines():
        if current is None:
            if re.match(r"^\s*```ya?ml\s*$", line):
                current = []
        elif FENCE.match(line):
            block = "\n".join(current) + "\n"
            if re.search(r"^name:", block, re.M) and re.search(r"^datasets:", block, re.M):
                blocks.append(block)
            current = None
        else:
            current.append(line)
    return blocks


def _examples() -> list[tuple[str, str]]:
    readme, docs = _repository_pages()
    return [
        (f"{page.name}#{number}", block)
        for page in [readme, *docs]
        for number, block in enumerate(pipeline_examples(page), start=1)
    ]


def test_the_docs_hold_pipeline_file_examples() -> None:
    assert _examples(), "no fenced yaml block with name: and datasets: in README.md or docs/"


@pytest.mark.parametrize(("where", "block"), _examples(), ids=[where for where, _ in _examples()])
def test_every_pipeline_file_example_loads(where: str, block: str, tmp_path: Path) -> None:
    path = tmp_path / "pipeline.yaml"
    path.write_text(block, encoding="utf-8")
    load_config(path, runtime_checks=False)
