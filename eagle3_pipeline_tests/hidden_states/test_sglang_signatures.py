"""Every SGLang name each release's worker path uses (``Release.uses`` of
:mod:`eagle3_pipeline.hidden_states.sglang_api`: modules, classes, methods, functions,
attributes, the keyword parameters it passes and how many positional ones) and its aux-tensor
contract (``Release.aux``) are in that release's wheel, read with ``ast``
(``eagle3_pipeline_tests/hidden_states/sglang_source.py``; wheels from ``sglang_wheels.py``).

Then, for each of the changes between 0.5.14 and 0.5.23 that break a 0.5.14 worker (the seven of
issue 27 and the process groups, found when checking them), one entry of the 0.5.23 path is put
back as 0.5.14 had it, and the check must report it.
"""

from __future__ import annotations

import re

import pytest

from eagle3_pipeline.config import HiddenStatesConfig
from eagle3_pipeline.hidden_states.sglang_api import (
    RELEASES,
    SUPPORTED_VERSIONS,
    AuxForm,
    Release,
    SGLangUse,
)
from eagle3_pipeline_tests.hidden_states.sglang_source import check_release, check_uses
from eagle3_pipeline_tests.hidden_states.sglang_wheels import wheel_source


def describe(use: SGLangUse) -> str:
    details = ", ".join(
        filter(
            None,
            [
                f"keywords {list(use.keywords)}" if use.keywords else "",
                f"{use.positional} positional" if use.positional else "",
                "read" if use.reads else "",
            ],
        )
    )
    return f"{use.kind:9} {use.module}.{use.name}" + (f" ({details})" if details else "")


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_every_sglang_name_of_a_release_is_in_its_wheel(version: str) -> None:
    release = RELEASES[version]
    tree, version_file = wheel_source(version)
    problems = check_release(tree, release)
    print(f"\n-- sglang {version}: {len(release.uses)} names, {len(release.aux)} aux forms; findings: {len(problems)}")
    for use in release.uses:
        print("   " + describe(use))
    for entry in release.aux:
        print(f"   aux form  {entry.module}.{entry.decoder}: {entry.form}")
    assert problems == [], "\n".join(problems)
    assert f"__version__ = version = '{version}'" in version_file


def swap(release: Release, name: str, *replacements: SGLangUse) -> tuple[SGLangUse, ...]:
    """The release's uses with the entry ``name`` replaced (or removed, with no replacement)."""
    assert any(use.name == name for use in release.uses), name
    return tuple(u for use in release.uses for u in ((*replacements,) if use.name == name else (use,)))


def entry(release: Release, name: str) -> SGLangUse:
    [found] = [use for use in release.uses if use.name == name]
    return found


NEW, OLD = RELEASES["0.5.23"], RELEASES["0.5.14"]
# Each break: the 0.5.23 path with one thing as 0.5.14 had it → what the check must say about it.
BREAKS = {
    "1 ServerArgs not published": (
        swap(NEW, "publish"),
        NEW.aux,
        r"ModelRunner calls assert_published\(\.\.\.\): the worker must call publish first",
    ),
    "2 resolved values read off ServerArgs": (
        (*NEW.uses, entry(OLD, "ServerArgs.page_size")),
        NEW.aux,
        r"ServerArgs\.page_size: ServerArgs resolves lazily \(resolve_once\); its fields keep the raw input",
    ),
    "3 ModelRunner with the tp/pp/ep ranks": (
        swap(NEW, "ModelRunner", entry(OLD, "ModelRunner")),
        NEW.aux,
        r"ModelRunner\(\): no parameter\(s\) \['tp_rank', 'tp_size', 'moe_ep_rank', 'moe_ep_size', 'pp_rank', "
        r"'pp_size'\]",
    ),
    "4 ChunkCache": (
        swap(NEW, "UnifiedRadixCache", entry(OLD, "ChunkCache")),
        NEW.aux,
        r"sglang\.srt\.mem_cache\.chunk_cache\.ChunkCache: no module sglang\.srt\.mem_cache\.chunk_cache",
    ),
    "5 Req.fill_len": (
        swap(NEW, "Req.extend_end", entry(OLD, "Req.fill_len")),
        NEW.aux,
        r"Req\.fill_len: no attribute fill_len",
    ),
    "6 ForwardBatch.init_new without its required keyword-only argument": (
        swap(NEW, "ForwardBatch.init_new", entry(OLD, "ForwardBatch.init_new")),
        NEW.aux,
        r"ForwardBatch\.init_new\(\): required keyword-only parameter\(s\) \['return_hidden_states_before_norm'\] "
        r"not passed",
    ),
    "7 DeepSeek aux states as a list": (
        NEW.uses,
        (
            *[a for a in NEW.aux if a.decoder != "DeepseekV2Model"],
            AuxForm(NEW.aux[1].module, "DeepseekV2Model", "list"),
        ),
        r"DeepseekV2Model\.forward hands the LogitsProcessor one packed \[N, K\*H\] tensor; the release's AuxForm "
        r"says a list",
    ),
    "8 no process groups (bootstrap.init_parallel_runtime)": (
        swap(NEW, "init_parallel_runtime"),
        NEW.aux,
        r"no entry the worker calls reaches init_distributed_environment",
    ),
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_a_0514_entry_point_on_the_0523_path_is_reported(name: str) -> None:
    uses, aux, expected = BREAKS[name]
    tree, _ = wheel_source("0.5.23")
    problems = check_uses(tree, uses, aux)
    print(f"\n-- break {name}: {problems}")
    assert len(problems) == 1 and re.search(expected, problems[0]), problems


def test_the_0514_path_is_refused_by_the_0523_wheel_and_the_0523_path_by_the_0514_wheel() -> None:
    for version, other in (("0.5.23", OLD), ("0.5.14", NEW)):
        tree, _ = wheel_source(version)
        problems = check_release(tree, other)
        print(f"\n-- sglang {other.version}'s entry points against the {version} wheel: {len(problems)} findings")
        for problem in problems:
            print("   " + problem)
        assert problems


def test_the_settings_name_the_supported_versions() -> None:
    fields = HiddenStatesConfig.model_fields
    for version in SUPPORTED_VERSIONS:
        assert f"sglang {version}" in str(fields["backend"].description)
        assert f"sglang=={version}" in str(fields["sglang_python"].description)
