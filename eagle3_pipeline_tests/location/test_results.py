"""The typed phase results: what `from_metadata` refuses (naming the field and what was expected) and
that `as_metadata` gives back what the phase reported, typed fields and the rest alike."""

from __future__ import annotations

import pytest

from eagle3_pipeline.results import DrafterResult, HiddenStatesResult, ResponsesResult, ResultError

RESPONSES = {"rows": 3, "generated_now": 3, "completion_tokens": 24, "truncated": 0, "data_version": "v"}
STORE = {"store": "/s", "samples": 6, "tokens": 60, "bytes": 6000, "bytes_per_token": 100.0,
         "bytes_per_token_formula": 100, "target_hidden_size": 8, "aux_layer_ids": [1, 2, 3], "shards": 2}  # fmt: skip


def test_a_missing_field_is_named_with_what_the_result_has() -> None:
    lacking = {k: v for k, v in RESPONSES.items() if k not in ("truncated", "rows")}
    with pytest.raises(ResultError) as refused:
        ResponsesResult.from_metadata(lacking)
    assert str(refused.value) == (
        "ResponsesResult: the phase's result lacks rows, truncated "
        "(it has: completion_tokens, data_version, generated_now)"
    )


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [("rows", "3", "<class 'int'>"), ("rows", True, "<class 'int'>"), ("data_version", 1, "<class 'str'>")],
)
def test_a_field_of_the_wrong_type_is_named_with_its_value_and_type(field: str, value: object, expected: str) -> None:
    with pytest.raises(ResultError) as refused:
        ResponsesResult.from_metadata({**RESPONSES, field: value})
    assert str(refused.value) == (
        f"ResponsesResult: the phase's result has the wrong type in {field} = {value!r} (expected {expected})"
    )


def test_every_wrong_field_is_named_at_once() -> None:
    metadata = {"steps": 5.0, "total_steps": 5, "first_loss": "x", "last_loss": None, "export_dir": "/e"}
    with pytest.raises(ResultError, match=r"steps = 5.0 \(expected <class 'int'>\); first_loss = 'x' \(expected float"):
        DrafterResult.from_metadata(metadata)
    with pytest.raises(ResultError, match=r"aux_layer_ids = \(1, 2, 3\) \(expected <class 'list'>\)"):
        HiddenStatesResult.from_metadata({**STORE, "aux_layer_ids": (1, 2, 3)})


def test_as_metadata_is_what_the_phase_reported() -> None:
    reported = {**STORE, "shards_written": 2, "tau@3/chat": 2.5, "per_dataset": {"B1": {"rows": 3}}}
    result = HiddenStatesResult.from_metadata(reported)
    assert result.as_metadata() == {**reported, "shards_reused": None}
    assert list(result.as_metadata())[: len(HiddenStatesResult.model_fields)] == list(HiddenStatesResult.model_fields)
    assert (result.samples, result.shards_written, result.extra["tau@3/chat"]) == (6, 2, 2.5)
    drafter = DrafterResult.from_metadata(
        {"steps": 5, "total_steps": 5, "first_loss": 2, "last_loss": None, "export_dir": "/e"}
    )
    assert drafter.first_loss == 2.0 and drafter.last_loss is None
