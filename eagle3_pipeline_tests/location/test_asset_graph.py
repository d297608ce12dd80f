"""The asset graph of each shipped profile, against a readable snapshot committed beside this file
(``snapshots/asset_graph_<profile>.txt``): asset keys, what each is (materialized or observed), group,
kinds, deps, partitions, pools and checks (blocking or not). A change to the graph shows up as a diff of
that text in review. After an intended change, rewrite the snapshots with::

    .venv/bin/python -m eagle3_pipeline_tests.location.test_asset_graph
"""

from __future__ import annotations

import difflib
from pathlib import Path

import dagster as dg
import pytest

from eagle3_pipeline.components.pipeline import build_definitions
from eagle3_pipeline.config import load_config, local_profile_path

PROFILES = ("local", "kimi-k25")
SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = ".venv/bin/python -m eagle3_pipeline_tests.location.test_asset_graph"


def _partitions(definition: dg.PartitionsDefinition | None) -> str:
    if definition is None:
        return "none"
    if isinstance(definition, dg.StaticPartitionsDefinition):
        return "static: " + ", ".join(definition.get_partition_keys())
    return type(definition).__name__


def _keys(keys: object) -> str:
    names = sorted(key.to_user_string() for key in keys)  # type: ignore[attr-defined]
    return ", ".join(names) or "none"


def render(defs: dg.Definitions) -> str:
    """The graph as text, one block per asset in key order."""
    graph = defs.resolve_asset_graph()
    blocks = []
    for key in sorted(graph.get_all_asset_keys(), key=lambda k: k.to_user_string()):
        node = graph.get(key)
        kind = "materialized" if node.is_materializable else "observed" if node.is_observable else "external"
        checks = [
            f"{check.name}{' (blocking)' if graph.get_check_spec(check).blocking else ''}"
            for check in sorted(node.check_keys, key=lambda c: c.name)
        ]
        blocks.append(
            "\n".join(
                [
                    f"asset {key.to_user_string()} ({kind})",
                    f"  group: {node.group_name}",
                    f"  kinds: {', '.join(sorted(node.kinds)) or 'none'}",
                    f"  deps: {_keys(node.parent_keys)}",
                    f"  partitions: {_partitions(node.partitions_def)}",
                    f"  pools: {', '.join(sorted(node.pools or ())) or 'none'}",
                    f"  checks: {', '.join(checks) or 'none'}",
                ]
            )
        )
    return "\n\n".join(blocks) + "\n"


def snapshot_of(profile: str) -> str:
    config = load_config(Path(local_profile_path()).parent / f"{profile}.yaml", runtime_checks=False)
    return f"# The asset graph of profiles/{profile}.yaml; rewrite with: {UPDATE}\n\n" + render(
        build_definitions(config)
    )


@pytest.mark.parametrize("profile", PROFILES)
def test_the_asset_graph_matches_its_snapshot(profile: str) -> None:
    path = SNAPSHOTS / f"asset_graph_{profile}.txt"
    assert path.is_file(), f"no snapshot {path}: write it with `{UPDATE}`"
    now = snapshot_of(profile)
    diff = "".join(difflib.unified_diff(path.read_text().splitlines(True), now.splitlines(True), str(path), "now"))
    assert not diff, f"the asset graph of {profile} changed; if intended, rewrite the snapshots with `{UPDATE}`\n{diff}"


if __name__ == "__main__":
    SNAPSHOTS.mkdir(exist_ok=True)
    for name in PROFILES:
        (SNAPSHOTS / f"asset_graph_{name}.txt").write_text(snapshot_of(name))
        print(f"wrote {SNAPSHOTS / f'asset_graph_{name}.txt'}")
