"""The serving-reference recording: what the serving target answers for a few training_data rows,
kept for hidden_states' validation (``hidden_states/validation.py``) to check the extracted teacher
against.

Recorded while a server is up (``training_data`` time, or the ``hidden_states`` preflight), since with
``backend: sglang`` the serving server is stopped while the states are extracted. The server APIs it
reads and what it records: DESIGN.md "The serving reference".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from eagle3_pipeline.config import ServingValidationConfig
from eagle3_pipeline.hosts.tunnel import reach
from eagle3_pipeline.training_data.agreement import (
    CONTEXT_TOKENS,
    RemoteTokenizerError,
    ServerEndpoint,
    TokenizeRouteMissing,
    remote_tokenizer,
)
from eagle3_pipeline.training_data.reader import TrainingData, iter_rows

REFERENCE_FORMAT = 1

Api = Literal["sglang", "vllm", "text"]
# Called with every reply's body (ServerAsker).
AfterReply = Callable[[Any], None]


class ServingReferenceError(RuntimeError):
    """The server could not be asked, or answered something this module cannot read."""


@dataclass
class ReferenceSample:
    """The server's answers for one sample: at ``positions[k]`` (the prediction after
    ``input_ids[: positions[k] + 1]``) its greedy token ``top1[k]`` (None: unknown; on the text path
    the answer was not one token, or the prefix's text does not tokenize back to the row's ids) and
    ``margin[k]`` (top-1 − top-2 logprob; None where unknown)."""

    sample_id: str
    input_ids: list[int]
    positions: list[int]
    top1: list[int | None]
    margin: list[float | None]
    tokenization: str  # "same", "not checked: …", or the first difference


@dataclass
class ServingReference:
    """What the serving server (``server``, asked through ``api`` for ``model``) answered for the
    reference samples of training_data ``training_data_version``, tokenized by ``tokenizer``."""

    server: str
    api: Api
    model: str
    training_data_version: str
    tokenizer: str
    samples: list[ReferenceSample] = field(default_factory=list)
    format: int = REFERENCE_FORMAT

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(path)
        return path


def reference_rows(data: TrainingData, count: int) -> list[dict[str, Any]]:
    """The ``count`` rows (train and eval) whose id has the smallest SHA-256, in that order."""
    files = data.shard_files("train") + data.shard_files("eval")
    ids = [row["id"] for path in files for row in iter_rows(path, ["id"])]
    chosen = sorted(ids, key=lambda i: hashlib.sha256(i.encode()).hexdigest())[:count]
    wanted = set(chosen)
    rows = {row["id"]: row for path in files for row in iter_rows(path, ["id", "input_ids"]) if row["id"] in wanted}
    return [{"id": i, "input_ids": list(rows[i]["input_ids"])} for i in chosen]


def _root(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


class ServerAsker:
    """The serving server over one HTTP connection pool; errors name the URL, never the key.
    ``after_reply``: handed every reply's body (a vLLM extraction server's connector writes a
    hidden-state file for every completion, which the caller deletes); it raises
    :class:`ServingReferenceError`."""

    def __init__(self, endpoint: ServerEndpoint, timeout_s: float, after_reply: AfterReply | None = None) -> None:
        import httpx

        self.endpoint = endpoint
        self.after_reply = after_reply
        headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        self.client = httpx.Client(headers=headers, timeout=timeout_s)

    def _safe(self, text: str) -> str:
        key = self.endpoint.api_key
        return text.replace(key, "***") if key else text

    def post(self, url: str, body: dict[str, Any]) -> tuple[int, Any]:
        import httpx

        try:
            response = self.client.post(reach(url), json=body)
        except httpx.HTTPError as exc:
            raise ServingReferenceError(self._safe(f"{url}: {type(exc).__name__}: {exc}")) from None
        try:
            payload = response.json()
        except ValueError:
            payload = response.text[:200]
        if self.after_reply is not None:
            self.after_reply(payload)
        return response.status_code, payload

    def fail(self, url: str, what: str, payload: Any) -> ServingReferenceError:
        return ServingReferenceError(self._safe(f"{url}: expected {what}, got {str(payload)[:300]!r}"))

    def close(self) -> None:
        self.client.close()


def _margin(logprobs: list[float]) -> float | None:
    ordered = sorted(logprobs, reverse=True)
    return ordered[0] - ordered[1] if len(ordered) > 1 else None


def sglang_predictions(asker: ServerAsker, ids: Sequence[int]) -> list[tuple[int, float | None]] | None:
    """Per position ``t < len(ids) - 1``: SGLang's top-1 for token ``t + 1`` and its margin; None
    when the server has no ``/generate`` route."""
    url = _root(asker.endpoint.base_url) + "/generate"
    body = {
        "input_ids": list(ids),
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
    }
    status, payload = asker.post(url, body)
    if status in (404, 405):
        return None
    if status != 200:
        raise asker.fail(url, "HTTP 200", f"HTTP {status}: {payload}")
    try:
        tops = payload["meta_info"]["input_top_logprobs"]
        found = []
        for entry in tops[1 : len(ids)]:
            pairs = [(float(lp), int(tid)) for lp, tid, *_ in entry]
            best = max(pairs)
            found.append((best[1], _margin([lp for lp, _ in pairs])))
    except (KeyError, TypeError, ValueError, IndexError):
        raise asker.fail(
            url, "meta_info.input_top_logprobs: per input token a list of [logprob, token_id, text]", payload
        ) from None
    if len(found) != len(ids) - 1:
        raise asker.fail(url, f"{len(ids)} entries in meta_info.input_top_logprobs", payload)
    return found


def vllm_predictions(asker: ServerAsker, ids: Sequence[int]) -> list[tuple[int, float | None]] | None:
    """Per position ``t < len(ids) - 1``: vLLM's rank-1 token for token ``t + 1`` and its margin;
    None when the completions route gives no ``prompt_logprobs``."""
    url = asker.endpoint.base_url.rstrip("/") + "/completions"
    body = {"model": asker.endpoint.model, "prompt": list(ids), "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    status, payload = asker.post(url, body)
    if status != 200 or not isinstance(payload, dict):
        return None
    try:
        entries = payload["choices"][0].get("prompt_logprobs")
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    if not isinstance(entries, list):
        return None
    try:
        found = []
        for entry in entries[1 : len(ids)]:
            ranked = {int(tid): (int(v["rank"]), float(v["logprob"])) for tid, v in entry.items()}
            top = min(ranked, key=lambda tid: ranked[tid][0])
            found.append((top, _margin([lp for _, lp in ranked.values()])))
    except (KeyError, TypeError, ValueError, AttributeError):
        raise asker.fail(
            url, "choices[0].prompt_logprobs: per prompt token {token_id: {logprob, rank}}", payload
        ) from None
    if len(found) != len(ids) - 1:
        raise asker.fail(url, f"{len(ids)} entries in choices[0].prompt_logprobs", payload)
    return found


def text_prediction(asker: ServerAsker, prompt: str) -> tuple[str, int]:
    """A greedy 1-token completion of ``prompt``: its text and the server's prompt token count."""
    url = asker.endpoint.base_url.rstrip("/") + "/completions"
    body = {"model": asker.endpoint.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    status, payload = asker.post(url, body)
    if status != 200:
        raise asker.fail(url, "HTTP 200", f"HTTP {status}: {payload}")
    try:
        return str(payload["choices"][0]["text"]), int(payload["usage"]["prompt_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise asker.fail(url, "choices[0].text and usage.prompt_tokens", payload) from None


def _first_difference(mine: Sequence[int], theirs: Sequence[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), min(len(mine), len(theirs)))


def tokenization_check(
    asker: ServerAsker, text: str, local: Callable[[str], list[int]], decode: Callable[[list[int]], str]
) -> str:
    """The server's ``/tokenize`` of ``text`` against ours: ``same``, ``not checked: …`` or the first difference."""
    try:
        with remote_tokenizer(
            asker.endpoint.base_url, asker.endpoint.model, asker.endpoint.api_key, asker.client.timeout.read or 30.0
        ) as remote:
            theirs = remote(text)
    except TokenizeRouteMissing as exc:
        return f"not checked: {exc}"
    except RemoteTokenizerError as exc:
        raise ServingReferenceError(str(exc)) from None
    mine = local(text)
    if mine == theirs:
        return "same"
    at = _first_difference(mine, theirs)

    def window(ids: list[int]) -> str:
        return "[" + ", ".join(f"{t} {decode([t])!r}" for t in ids[at : at + CONTEXT_TOKENS]) + "]"

    return (
        f"the server tokenizes the sample's text differently from training_data's tokenizer from token {at} "
        f"(character {len(decode(mine[:at]))}; ours {len(mine)} tokens, the server's {len(theirs)}): from there ours "
        f"{window(mine)} vs the server's {window(theirs)}"
    )


def _text_positions(length: int, count: int) -> list[int]:
    """``count`` positions spread evenly over ``0..length-2`` (the last has no next token to compare)."""
    last = length - 2
    if last < 0:
        return []
    if count >= last + 1:
        return list(range(last + 1))
    return sorted({round(k * last / (count - 1)) for k in range(count)}) if count > 1 else [last]


def _text_sample(asker: ServerAsker, row: dict[str, Any], tokenizer: Any, count: int) -> ReferenceSample:
    ids = row["input_ids"]
    positions, top1, tokenization = [], [], "same (usage.prompt_tokens against ours for every checked prefix)"
    for t in _text_positions(len(ids), count):
        prompt = tokenizer.decode(ids[: t + 1])
        text, prompt_tokens = text_prediction(asker, prompt)
        ours = tokenizer(prompt)["input_ids"]
        if prompt_tokens != len(ours) and tokenization.startswith("same"):
            tokenization = (
                f"the server counts {prompt_tokens} prompt tokens in the text of the sample's first {t + 1} tokens "
                "where "
                f"training_data's tokenizer counts {len(ours)}: {prompt[-80:]!r}"
            )
        piece = tokenizer.encode(text, add_special_tokens=False)
        positions.append(t)
        # The server saw the prefix's text, not our ids: its answer is about our ids only where the text
        # tokenizes back to them, and names one of our tokens only where it is one token.
        same_ids = tokenizer.encode(prompt, add_special_tokens=False) == list(ids[: t + 1])
        top1.append(piece[0] if len(piece) == 1 and same_ids else None)
    return ReferenceSample(row["id"], list(ids), positions, top1, [None] * len(positions), tokenization)


def _choose_api(asker: ServerAsker, ids: Sequence[int]) -> tuple[Api, list[tuple[int, float | None]] | None]:
    found = sglang_predictions(asker, ids)
    if found is not None:
        return "sglang", found
    found = vllm_predictions(asker, ids)
    if found is not None:
        return "vllm", found
    return "text", None


def record_reference(
    training_data: Path,
    endpoint: ServerEndpoint,
    *,
    tokenizer: Any,
    tokenizer_name: str,
    settings: ServingValidationConfig,
    out: Path,
    after_reply: AfterReply | None = None,
) -> ServingReference:
    """Ask ``endpoint`` about the reference samples of ``training_data`` and write the answers to
    ``out``; ``tokenizer`` is the one the rows were made with (``after_reply``: :class:`ServerAsker`).
    :class:`ServingReferenceError` when the server cannot be asked or answers what cannot be read."""
    data = TrainingData.open(training_data)
    rows = reference_rows(data, settings.samples)
    asker = ServerAsker(endpoint, settings.timeout_s, after_reply)
    api: Api | None = None
    samples = []

    def local(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    try:
        for row in rows:
            ids = row["input_ids"][: settings.max_positions + 1]
            if api is None:
                api, found = _choose_api(asker, ids)
            else:
                found = (
                    sglang_predictions(asker, ids)
                    if api == "sglang"
                    else vllm_predictions(asker, ids)
                    if api == "vllm"
                    else None
                )
            if api == "text":
                samples.append(_text_sample(asker, row, tokenizer, settings.text_positions))
                continue
            if found is None:
                raise ServingReferenceError(f"{endpoint.base_url}: stopped answering {api} logprob requests")
            tokenization = tokenization_check(asker, tokenizer.decode(row["input_ids"]), local, tokenizer.decode)
            samples.append(
                ReferenceSample(
                    row["id"],
                    list(row["input_ids"]),
                    list(range(len(found))),
                    [t for t, _ in found],
                    [m for _, m in found],
                    tokenization,
                )
            )
    finally:
        asker.close()
    reference = ServingReference(
        endpoint.base_url, api or "text", endpoint.model, data.version(), tokenizer_name, samples
    )
    reference.save(out)
    return reference


def load_reference(path: Path, version: str) -> tuple[ServingReference | None, str]:
    """The reference at ``path`` if it was recorded for training_data ``version``, or None and why not."""
    path = Path(path)
    if not path.is_file():
        return (
            None,
            f"{path}: no reference recorded (no serving server was reachable at training_data or hidden_states time)",
        )
    try:
        raw = json.loads(path.read_text())
        raw["samples"] = [ReferenceSample(**s) for s in raw["samples"]]
        reference = ServingReference(**raw)
    except (ValueError, TypeError, KeyError) as exc:
        raise ServingReferenceError(f"{path}: not a serving reference ({type(exc).__name__}: {exc})") from None
    if reference.training_data_version != version:
        return (
            None,
            f"{path}: recorded for training_data version {reference.training_data_version}, the rows are now {version}",
        )
    if not reference.samples:
        return None, f"{path}: no sample in the reference"
    return reference, ""


def tokenization_problems(reference: ServingReference) -> list[str]:
    return [
        f"sample {s.sample_id!r}: {s.tokenization}"
        for s in reference.samples
        if not s.tokenization.startswith(("same", "not checked"))
    ]


def record_from_first(
    training_data: Path,
    endpoints: Sequence[ServerEndpoint],
    *,
    tokenizer_name: str,
    trust_remote_code: bool,
    settings: ServingValidationConfig,
    out: Path,
    after_reply: AfterReply | None = None,
) -> dict[str, Any]:
    """Record the reference from the first of ``endpoints`` that answers; what was done, as metadata
    (``serving_reference_status``: ``recorded from …``, ``off`` or ``not recorded: …`` with the reasons).
    ``after_reply``: :class:`ServerAsker`."""
    if not settings.samples:
        return {"serving_reference_status": "off (hidden_states.validation.samples is 0)"}
    if not endpoints:
        return {"serving_reference_status": "not recorded: no serving endpoint to ask"}
    from eagle3_pipeline.target.folder import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_name, trust_remote_code)
    reasons = []
    for endpoint in endpoints:
        try:
            reference = record_reference(
                training_data,
                endpoint,
                tokenizer=tokenizer,
                tokenizer_name=tokenizer_name,
                settings=settings,
                out=out,
                after_reply=after_reply,
            )
        except ServingReferenceError as exc:
            reasons.append(str(exc))
            continue
        problems = tokenization_problems(reference)
        return {
            "serving_reference_status": f"recorded from {reference.server} ({reference.api}): "
            f"{len(reference.samples)} samples, {sum(len(s.positions) for s in reference.samples)} positions"
            + (f"; tokenization differs: {problems[0]}" if problems else ""),
        }
    return {"serving_reference_status": "not recorded: " + "; ".join(reasons)}
