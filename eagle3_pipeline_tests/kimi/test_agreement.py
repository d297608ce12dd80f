"""The local tokenizer against the server's, over real HTTP: the project's loopback OpenAI server
answering ``POST /tokenize`` with the Kimi stand-in's tokenizer."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline.target.folder import load_tokenizer
from eagle3_pipeline.testing.fake_openai import FakeOpenAI
from eagle3_pipeline.training_data.agreement import (
    AgreementResult,
    RemoteTokenizerError,
    TokenizerDisagreement,
    TokenizeRouteMissing,
    check_agreement,
    remote_tokenizer,
)

KEY = "sk-agreement-secret"
CONVERSATIONS = [
    [{"role": "user", "content": "Name a prime."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "说一个质数。"},
    ],
]


def encoder(tokenizer: Any) -> Any:
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def kimi(kimi_checkpoint: Path) -> Any:
    return load_tokenizer(str(kimi_checkpoint), trust_remote_code=True)


@pytest.fixture(scope="module")
def kimi_split_think(kimi_checkpoint_split_think: Path) -> Any:
    return load_tokenizer(str(kimi_checkpoint_split_think), trust_remote_code=True)


@pytest.fixture
def texts(kimi: Any) -> list[str]:
    """Rendered prompts with the thinking markup in them: generation prompts end with ``<think>``,
    a finished turn renders ``<think></think>``."""
    out = [str(kimi.apply_chat_template(c, tokenize=False, add_generation_prompt=True)) for c in CONVERSATIONS]
    finished = [*CONVERSATIONS[0], {"role": "assistant", "content": "Seven."}]
    out.append(str(kimi.apply_chat_template(finished, tokenize=False, add_generation_prompt=False)))
    assert all("<think>" in t for t in out)
    return out


def test_the_same_tokenizer_on_both_sides_agrees(fake_openai: FakeOpenAI, kimi: Any, texts: list[str]) -> None:
    fake_openai.tokenize = encoder(kimi)
    with remote_tokenizer(fake_openai.base_url, "kimi-k2.5", api_key=KEY) as remote:
        result = check_agreement(texts, encoder(kimi), remote, decode=kimi.decode)
    assert result == AgreementResult(samples=len(texts), tokens=sum(len(encoder(kimi)(t)) for t in texts))
    assert [r["prompt"] for r in fake_openai.tokenize_requests] == texts
    assert {(r["model"], r["add_special_tokens"], r["authorization"]) for r in fake_openai.tokenize_requests} == {
        ("kimi-k2.5", False, f"Bearer {KEY}")
    }
    assert fake_openai.requests == [], "the tokenize route is not a chat completion"


def test_a_tokenizer_that_splits_think_fails_at_the_first_differing_token(
    fake_openai: FakeOpenAI, kimi: Any, kimi_split_think: Any, texts: list[str]
) -> None:
    fake_openai.tokenize = encoder(kimi)
    server_ids = encoder(kimi)(texts[0])
    at = server_ids.index(kimi.convert_tokens_to_ids("<think>"))
    assert encoder(kimi_split_think)(texts[0])[:at] == server_ids[:at]
    with remote_tokenizer(fake_openai.base_url, "kimi-k2.5") as remote, pytest.raises(TokenizerDisagreement) as failure:
        check_agreement(texts, encoder(kimi_split_think), remote, decode=kimi_split_think.decode)
    message = str(failure.value)
    print(f"\n{message}")
    assert message.startswith(f"sample 0: the local tokenizer and the server's disagree at token {at} ")
    local_side, server_side = message.split(" vs server ")
    # The server's <think> id, shown with the local tokenizer's piece for it (not <think> there).
    assert server_side.endswith(f"{server_ids[at]} '<|reserved_token_{server_ids[at]}|>']")
    assert "'<'" in local_side and "'>'" in local_side and "'<think>'" not in local_side  # <think> in byte-level pieces
    assert len(fake_openai.tokenize_requests) == 1, "stops at the first disagreement"


def test_a_server_without_the_route_is_named_not_checked(fake_openai: FakeOpenAI, kimi: Any) -> None:
    root = fake_openai.base_url.removesuffix("/v1")
    with (
        remote_tokenizer(fake_openai.base_url, "kimi-k2.5", api_key=KEY) as remote,
        pytest.raises(TokenizeRouteMissing) as missing,
    ):
        check_agreement(["Hi"], encoder(kimi), remote)
    assert str(missing.value).startswith(f"{root}/tokenize: HTTP 404, the server has no tokenize route")
    assert KEY not in str(missing.value)


def test_an_unreachable_server_is_named_by_url_never_by_key(kimi: Any) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with remote_tokenizer(f"http://127.0.0.1:{port}/v1", "kimi-k2.5", api_key=KEY, timeout_s=2) as remote:
        with pytest.raises(RemoteTokenizerError, match=rf"^http://127.0.0.1:{port}/tokenize: ConnectError") as failure:
            remote("Hi")
    assert KEY not in str(failure.value)
