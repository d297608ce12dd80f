"""The inference provider's configured endpoints, each probed by the health gate before use — against
real loopback servers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from eagle3_pipeline.config import load_config
from eagle3_pipeline.generation import Price
from eagle3_pipeline.health.gate import UnhealthyError
from eagle3_pipeline.inference.provider import InferenceProvider
from eagle3_pipeline.testing.fake_openai import FakeOpenAI, Reply


@pytest.fixture
def second_server() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI().start()
    yield server
    server.stop()


def test_every_configured_endpoint_is_probed_before_use(
    tmp_path: Path, fake_openai: FakeOpenAI, second_server: FakeOpenAI
) -> None:
    (tmp_path / "p.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')

    def provider(urls: list[str]) -> InferenceProvider:
        entries = "".join(
            f"    - {{base_url: '{url}', price: {{prompt_per_mtok: 1, completion_per_mtok: 3}}}}\n" for url in urls
        )
        (tmp_path / "pipeline.yaml").write_text(
            "name: two\nartifacts_root: out\ntarget: {model: m, tokenizer: t}\n"
            f"inference:\n  kind: endpoints\n  endpoints:\n{entries}datasets:\n  - {{id: B1, source: p.jsonl}}\n"
        )
        return InferenceProvider(load_config(tmp_path / "pipeline.yaml"))

    endpoints = provider([fake_openai.base_url, second_server.base_url]).endpoints()
    assert [e.base_url for e in endpoints] == [fake_openai.base_url, second_server.base_url]
    assert endpoints[0].price == Price(1.0, 3.0) and endpoints[0].model == "m"
    assert len(fake_openai.requests) == len(second_server.requests) == 1, "one 1-token probe each"
    second_server.script = lambda body, n: Reply(status=503)
    with pytest.raises(UnhealthyError, match=second_server.base_url) as caught:
        provider([fake_openai.base_url, second_server.base_url]).endpoints()
    assert fake_openai.base_url not in str(caught.value)
