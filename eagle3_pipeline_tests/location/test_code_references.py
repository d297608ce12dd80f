"""From an asset page to the code in one step: every asset carries a code reference to the function that
computes it (the module function named after it, in the module of components/ named after it), ahead of
the component's defs.yaml; an observed server asset points at the function that makes its observations,
in `inference_server.py`. Real definitions, nothing stubbed."""

from __future__ import annotations

import re
from pathlib import Path

import dagster as dg
import pytest

from eagle3_pipeline.components.pipeline import build_definitions
from eagle3_pipeline.config import load_config, local_profile_path

PACKAGE = Path(__file__).resolve().parents[2] / "eagle3_pipeline"
DEF = re.compile(r"^\s*def (\w+)\(")


def _function_at(path: str, line: int) -> str:
    """The name of the function whose definition (decorators included) starts at ``line`` of ``path``."""
    lines = Path(path).read_text().splitlines()[line - 1 :]
    assert lines[0].lstrip().startswith(("@", "def ")), f"{path}:{line} starts no function: {lines[0]!r}"
    return next(match.group(1) for text in lines if (match := DEF.match(text)))


def _references(defs: dg.Definitions) -> dict[dg.AssetKey, tuple[list[dg.LocalFileCodeReference], bool]]:
    graph = defs.resolve_asset_graph()
    found = {}
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        value = node.metadata.get("dagster/code_references")
        assert isinstance(value, dg.CodeReferencesMetadataValue), f"{key.to_user_string()}: no code reference"
        found[key] = (
            [r for r in value.code_references if isinstance(r, dg.LocalFileCodeReference)],
            node.is_materializable,
        )
    return found


def _assert_each_points_at_its_function(defs: dg.Definitions) -> None:
    for key, (references, materializable) in _references(defs).items():
        first = references[0]
        assert Path(first.file_path).is_relative_to(PACKAGE / "components") and first.file_path.endswith(".py"), first
        expected = key.path[-1] if materializable else "health_observation"
        module = key.path[-1] if materializable else "inference_server"
        assert Path(first.file_path).stem == module, (key.to_user_string(), first.file_path)
        assert first.line_number is not None
        assert _function_at(first.file_path, first.line_number) == expected, (key.to_user_string(), first)


@pytest.mark.parametrize("profile", ["local.yaml", "kimi-k25.yaml"])
def test_every_asset_of_a_pipeline_points_at_the_function_that_computes_it(profile: str) -> None:
    config = load_config(Path(local_profile_path()).parent / profile, runtime_checks=False)
    _assert_each_points_at_its_function(build_definitions(config))


def test_the_code_locations_assets_point_at_their_function_first_then_at_the_components_defs_yaml() -> None:
    from eagle3_pipeline.definitions import defs

    _assert_each_points_at_its_function(defs)
    defs_yaml = PACKAGE / "defs" / "local" / "defs.yaml"
    for key, (references, _) in _references(defs).items():
        assert [Path(r.file_path) for r in references[1:]] == [defs_yaml], key.to_user_string()
