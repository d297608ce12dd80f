"""Server capabilities are probed once before a `responses` partition's requests go out: tools need a
tool-call parser, kept reasoning a reasoning parser, the longest prompt a long enough context, and
training_data's tokenizer check a `/tokenize` route. A missing one fails the partition before any of
its requests, naming the flag to add for vLLM and SGLang; a server that does not say (a hosted API)
is UNKNOWN and goes on.

Against the scripted OpenAI-compatible server on loopback, standing in for vLLM (its 400 answer to
tools without a parser is vLLM's own text, see `vllm/renderers/online_renderer.py`), for SGLang (its
server info) and for a hosted API; the real vLLM case is in real_vllm/test_target_alone.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from eagle3_pipeline.generation import Endpoint
from eagle3_pipeline.generation.capabilities import PROBE_PREFIX, CapabilityReport, ServerNeeds, probe_capabilities
from eagle3_pipeline.testing.datasets import write_jsonl
from eagle3_pipeline.testing.fake_openai import FakeOpenAI, Reply, echo_completion
from eagle3_pipeline_tests.dagster_runs import failure_description, materialize_generation
from eagle3_pipeline_tests.pipeline_files import load_pipeline

VLLM_REFUSAL = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


def needs(**fields: Any) -> ServerNeeds:
    base: dict[str, Any] = {
        "tools": None,
        "reasoning": False,
        "context_tokens": None,
        "estimator": "chars/4",
        "tokenize": False,
    }
    return ServerNeeds(**{**base, **fields})


def probe(server: FakeOpenAI, **fields: Any) -> CapabilityReport:
    return probe_capabilities([Endpoint(server.base_url, "target")], needs(**fields))


def refuses_tools(body: dict[str, Any], n: int) -> Reply:
    if body.get("tools"):
        error = {"message": VLLM_REFUSAL, "type": "BadRequestError", "param": None, "code": 400}
        return Reply(status=400, payload={"error": error})  # vLLM 0.32's ErrorResponse
    return Reply()


def test_tools_refused_by_the_server_are_a_missing_parser_named_for_both_servers(fake_openai: FakeOpenAI) -> None:
    fake_openai.script = refuses_tools
    [check] = probe(fake_openai, tools=TOOLS).checks
    assert (check.capability, check.status, check.blocking) == ("tool_call_parser", "missing", True)
    assert VLLM_REFUSAL in check.detail
    assert "start vLLM with --enable-auto-tool-choice --tool-call-parser <name>" in check.detail
    assert "SGLang with --tool-call-parser <name>" in check.detail
    [sent] = fake_openai.probe_requests
    assert sent["tools"] == TOOLS and sent["max_tokens"] == 1 and "tool_choice" not in sent, (
        "one tiny request shaped like the partition's (vLLM takes tool_choice auto for it, as for them)"
    )

    fake_openai.script = None
    [accepted] = probe(fake_openai, tools=TOOLS).checks
    assert accepted.status == "ok", accepted.line


def test_sglang_accepts_tools_without_a_parser_so_its_server_info_decides(fake_openai: FakeOpenAI) -> None:
    fake_openai.server_info = {"tool_call_parser": None, "reasoning_parser": None, "context_length": None}
    [check] = probe(fake_openai, tools=TOOLS).checks
    assert check.status == "missing" and "SGLang's server info has no tool_call_parser" in check.detail
    assert "SGLang with --tool-call-parser <name>" in check.detail

    fake_openai.server_info = {"tool_call_parser": "kimi_k2", "reasoning_parser": "kimi_k2"}
    tools, reasoning = probe(fake_openai, tools=TOOLS, reasoning=True).checks
    assert (tools.status, reasoning.status) == ("ok", "ok")
    assert "--tool-call-parser kimi_k2" in tools.detail and "--reasoning-parser kimi_k2" in reasoning.detail


@pytest.mark.parametrize(
    ("message", "status"),
    [
        ({"reasoning_content": "The user asks for a sum", "content": None}, "ok"),
        ({"reasoning": "The user asks for a sum", "content": None}, "ok"),
        ({"content": "<think>\nThe user asks for a sum"}, "missing"),
        ({"content": "42"}, "unknown"),
    ],
)
def test_kept_reasoning_needs_the_reasoning_parser_at_work(
    fake_openai: FakeOpenAI, message: dict[str, Any], status: str
) -> None:
    fake_openai.script = lambda body, n: Reply(payload=echo_completion(body, **message))
    [check] = probe(fake_openai, reasoning=True).checks
    assert (check.capability, check.status) == ("reasoning_parser", status), check.line
    if status == "missing":
        assert "inside the content (<think> in it)" in check.detail
        assert "start vLLM with --reasoning-parser <name>; SGLang with --reasoning-parser <name>" in check.detail
    if status == "unknown":
        assert "no evidence that this model reasons here" in check.detail
    [sent] = fake_openai.probe_requests
    assert sent["messages"][-1]["content"].startswith(PROBE_PREFIX) and sent["max_tokens"] == 16


def test_the_context_must_hold_the_longest_prompt_and_max_tokens(fake_openai: FakeOpenAI) -> None:
    [unknown] = probe(fake_openai, context_tokens=3000).checks
    assert unknown.status == "unknown" and "reports no max_model_len" in unknown.detail

    fake_openai.max_model_len = 2048
    [short] = probe(fake_openai, context_tokens=3000).checks
    assert short.status == "missing"
    assert "max_model_len is 2048, and the longest prompt with max_tokens needs 3000 tokens" in short.detail
    assert "start vLLM with --max-model-len 3000 or more; SGLang with --context-length 3000 or more" in short.detail
    [enough] = probe(fake_openai, context_tokens=2048).checks
    assert enough.status == "ok"
    assert not fake_openai.probe_requests, "read from GET /v1/models, no completion"


def test_a_missing_tokenize_route_is_reported_not_refused(fake_openai: FakeOpenAI) -> None:
    [missing] = probe(fake_openai, tokenize=True).checks
    assert (missing.status, missing.blocking) == ("missing", False)
    assert "answered 404" in missing.detail and "'not checked'" in missing.detail
    fake_openai.tokenize = lambda text: [1, 2, 3]
    [present] = probe(fake_openai, tokenize=True).checks
    assert present.status == "ok"
    assert fake_openai.tokenize_requests[-1]["add_special_tokens"] is False


def test_a_hosted_api_is_asked_only_what_the_dataset_needs(fake_openai: FakeOpenAI) -> None:
    """No tools, reasoning stripped, no tokenizer check: only the context, which a hosted API does not
    report; nothing fails and no completion is spent."""
    report = probe(fake_openai, context_tokens=100)
    assert [c.capability for c in report.checks] == ["context_length"] and not report.missing
    assert not fake_openai.probe_requests


def tool_prompts(count: int) -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": f"look up item {i}"}], "tools": TOOLS} for i in range(count)]


def test_the_partition_fails_before_any_request_then_runs_once_the_server_has_the_parser(
    tmp_path: Path, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script = refuses_tools
    fake_openai.max_model_len = 4096
    write_jsonl(tmp_path / "p.jsonl", tool_prompts(24))
    config = load_pipeline(
        tmp_path,
        {
            "name": "capabilities",
            "target": {"tokenizer": "unused", "max_seq_len": 4096},
            "inference": {"kind": "endpoints", "endpoints": [{"base_url": fake_openai.base_url}]},
            "generation": {"max_tokens": 8, "concurrency": 2, "length_estimator": "chars"},
            "datasets": [{"id": "T1", "source": "p.jsonl"}],
        },
        runtime_checks=True,
    )
    with dg.DagsterInstance.ephemeral() as instance:
        failed = materialize_generation(config, instance, "T1")
        assert not failed.success
        description = failure_description(failed)
        assert description.startswith("T1: the server lacks what this dataset needs, so no request of the partition")
        assert "tool_call_parser on http://127.0.0.1:" in description and VLLM_REFUSAL in description
        assert "start vLLM with --enable-auto-tool-choice --tool-call-parser <name>" in description
        sent = [r["messages"][-1]["content"] for r in fake_openai.requests]
        assert not [text for text in sent if text.startswith("look up item")], "no request of the partition"
        probes = [(bool(r.get("tools")), r["max_tokens"]) for r in fake_openai.probe_requests]
        assert probes == [(True, 1), (False, 16)], "one probe per capability: tools, then reasoning"

        fake_openai.script = None  # the server restarted with its tool-call parser
        passed = materialize_generation(config, instance, "T1")
    assert passed.success
    [materialization] = passed.asset_materializations_for_node("responses")
    checks = {c["capability"]: c["status"] for c in materialization.metadata["server_capabilities"].value}  # type: ignore[union-attr]
    assert checks == {
        "tool_call_parser": "ok",
        "reasoning_parser": "unknown",
        "context_length": "ok",
        "tokenize": "missing",
    }
    assert materialization.metadata["generated_now"].value == 24
