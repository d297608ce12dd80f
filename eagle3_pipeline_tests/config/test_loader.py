"""The pipeline file: the shipped profile loads; each malformed file gets one clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_pipeline.config import ConfigError, load_config, local_profile_path

VALID = """
name: demo
target: {model: m}
datasets:
  - {id: B1, source: data.jsonl}
"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "data.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    return tmp_path


def write(folder: Path, text: str) -> Path:
    path = folder / "pipeline.yaml"
    path.write_text(text)
    return path


def error_for(folder: Path, text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(write(folder, text))
    message = str(caught.value)
    assert str(folder / "pipeline.yaml") in message, message
    assert "Traceback" not in message
    return message


def test_shipped_local_profile_loads_with_four_datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EAGLE3_ARTIFACTS_ROOT", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    config = load_config(local_profile_path())
    assert len(config.datasets) >= 4
    assert config.inference.kind == "embedded"
    assert config.artifacts_root == tmp_path / "data" / "eagle3_pipeline" / "local", "the user's, by pipeline name"
    assert all(Path(ds.source).is_file() for ds in config.datasets)


def test_a_shipped_profile_writes_in_the_user_data_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not inside the installed package, not under the current directory."""
    monkeypatch.delenv("EAGLE3_ARTIFACTS_ROOT", raising=False)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_config(local_profile_path())
    assert config.artifacts_root == tmp_path / ".local" / "share" / "eagle3_pipeline" / "local"


@pytest.mark.parametrize("shipped", [False, True])
def test_the_default_artifacts_root_does_not_depend_on_the_current_directory(
    shipped: bool, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EAGLE3_ARTIFACTS_ROOT", raising=False)
    path = local_profile_path() if shipped else write(folder, VALID)
    roots = set()
    for cwd in (folder / "one", folder / "two"):
        cwd.mkdir()
        monkeypatch.chdir(cwd)
        roots.add(load_config(path).artifacts_root)
    [root] = roots
    if not shipped:
        assert root == folder / "artifacts" / "demo", "beside the pipeline file, scoped by its name"


def test_the_artifacts_variable_comes_first(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLE3_ARTIFACTS_ROOT", str(folder / "all"))
    assert load_config(write(folder, VALID)).artifacts_root == folder / "all" / "demo"
    assert load_config(local_profile_path()).artifacts_root == folder / "all" / "local"


def test_relative_paths_resolve_against_the_file(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EAGLE3_ARTIFACTS_ROOT", raising=False)
    config = load_config(write(folder, VALID + "artifacts_root: out\n"))
    assert config.datasets[0].source == str(folder / "data.jsonl")
    assert config.artifacts_root == folder / "out"


def test_invalid_yaml_names_line(folder: Path) -> None:
    message = error_for(folder, "name: demo\ntarget: {model: m\ndatasets: []\n")
    assert "invalid YAML" in message and "line" in message


def test_unknown_key_is_named(folder: Path) -> None:
    message = error_for(folder, VALID + "generaton: {max_tokens: 3}\n")
    assert "generaton: unknown key" in message


def test_unknown_nested_key_has_full_path(folder: Path) -> None:
    message = error_for(folder, VALID.replace("source: data.jsonl", "source: data.jsonl, budget: 5"))
    assert "datasets[0] (id 'B1').budget: unknown key" in message


def test_wrong_type_shows_value_and_expectation(folder: Path) -> None:
    message = error_for(folder, VALID + "generation: {concurrency: lots}\n")
    assert "generation.concurrency" in message and "'lots'" in message and "integer" in message


def test_missing_source_field(folder: Path) -> None:
    message = error_for(folder, VALID.replace(", source: data.jsonl", ""))
    assert "datasets[0] (id 'B1').source: required field is missing" in message


def test_negative_budget(folder: Path) -> None:
    message = error_for(folder, VALID.replace("source: data.jsonl", "source: data.jsonl, token_budget: -5"))
    assert "datasets[0] (id 'B1').token_budget" in message and "-5" in message and "greater than 0" in message


def test_duplicate_dataset_id(folder: Path) -> None:
    message = error_for(folder, VALID + "  - {id: B1, source: data.jsonl}\n")
    assert "'B1' appears more than once" in message


def test_source_path_that_does_not_exist(folder: Path) -> None:
    message = error_for(folder, VALID.replace("data.jsonl", "nope/missing.jsonl"))
    assert "datasets[0] (id 'B1').source" in message and "missing.jsonl" in message and "does not exist" in message


def test_source_path_that_is_unreadable(folder: Path) -> None:
    (folder / "adir.jsonl").mkdir()
    message = error_for(folder, VALID.replace("data.jsonl", "adir.jsonl"))
    assert "is not a readable file" in message


def test_missing_environment_variable_for_secret(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROUTER_KEY_FOR_TEST", raising=False)
    text = VALID + (
        "inference:\n  kind: endpoints\n  endpoints:\n"
        "    - {base_url: 'https://router.invalid/v1', api_key_env: ROUTER_KEY_FOR_TEST}\n"
    )
    message = error_for(folder, text.replace("target: {model: m}", "target: {model: m, tokenizer: t}"))
    assert "inference.endpoints[0].api_key_env" in message and "ROUTER_KEY_FOR_TEST is not set" in message


def test_secret_value_never_appears_in_errors(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROUTER_KEY_FOR_TEST", "sk-very-secret-value")
    text = VALID.replace("target: {model: m}", "target: {model: m}") + (
        "inference:\n  kind: endpoints\n  endpoints:\n"
        "    - {base_url: 'https://router.invalid/v1', api_key_env: ROUTER_KEY_FOR_TEST}\n"
    )
    message = error_for(folder, text)
    assert "target.tokenizer is required" in message
    assert "sk-very-secret-value" not in message


@pytest.mark.parametrize(
    ("section", "where"),
    [
        (
            "inference:\n  kind: endpoints\n  endpoints:\n    - {name: box, base_url: '%s'}\n",
            "inference.endpoints[0] (name 'box').base_url",
        ),
        ("health:\n  server: {kind: sglang, port: 30000, base_url: '%s'}\n", "health.server.base_url"),
        ("serving: {base_url: '%s'}\n", "serving.base_url"),
    ],
)
def test_a_base_url_with_credentials_is_refused_without_echoing_them(folder: Path, section: str, where: str) -> None:
    url = "https://alice:hunter2-secret@gpu-box:30000/v1"
    message = error_for(folder, VALID.replace("target: {model: m}", "target: {model: m, tokenizer: t}") + section % url)
    assert f"{where}: a URL with credentials (user:password@) is refused" in message
    assert "hunter2-secret" not in message and "alice" not in message


def test_endpoints_kind_needs_an_endpoint(folder: Path) -> None:
    message = error_for(
        folder,
        VALID.replace("target: {model: m}", "target: {model: m, tokenizer: t}") + "inference: {kind: endpoints}\n",
    )
    assert "at least one entry in inference.endpoints" in message


def test_bad_dataset_id_characters(folder: Path) -> None:
    message = error_for(folder, VALID.replace("id: B1", 'id: "B1; rm -rf /"'))
    assert "datasets[0]" in message and "should match pattern" in message


def test_top_level_must_be_a_mapping(folder: Path) -> None:
    assert "expected a mapping" in error_for(folder, "- just\n- a list\n")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pipeline file does not exist"):
        load_config(tmp_path / "absent.yaml")


def test_health_section_errors_name_the_field(folder: Path) -> None:
    message = error_for(folder, VALID + "health: {optional_checks: [gpu], watch_dir: data/out}\n")
    assert "health.optional_checks[0]" in message and "'gpu'" in message
    assert "health.watch_dir" in message and "'data/out'" in message


def test_ssh_host_needs_a_hostname(folder: Path) -> None:
    assert "needs health.host.hostname" in error_for(folder, VALID + "health: {host: {kind: ssh}}\n")


def test_optional_check_names_are_the_probes_names() -> None:
    import typing

    from eagle3_pipeline.config import CheckName
    from eagle3_pipeline.health import CHECK_NAMES

    assert set(typing.get_args(CheckName)) == set(CHECK_NAMES)
