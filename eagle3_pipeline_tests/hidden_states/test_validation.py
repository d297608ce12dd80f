"""Validation of the states against the serving target before a large extraction.

Stand-ins: the target is SmolLM2-135M-Instruct (for the 1T model); the serving server is a real
HTTP server on loopback (:class:`LogprobServer`) that answers SGLang's ``/generate`` or vLLM's
``/v1/completions`` with ``prompt_logprobs``, and ``/tokenize``, computed by transformers on the same
model with the served tokenizer (for SGLang / vLLM on GPUs). The broken teachers (a layer early,
shifted by a position, without the final norm) are the real model's states wrapped by
:class:`BrokenTeacher`, the mistakes a backend can make.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from eagle3_pipeline.config import ServingValidationConfig
from eagle3_pipeline.hidden_states.capture import Target, decoder_layers, load_target
from eagle3_pipeline.hidden_states.extract import _extract, run
from eagle3_pipeline.hidden_states.extract_spec import ExtractionError, parse_spec
from eagle3_pipeline.hidden_states.sharding import assign_shards
from eagle3_pipeline.target.folder import decoder, language_model, load_tokenizer
from eagle3_pipeline.testing.reference_texts import TEXTS, other_tokenizer, reference_of
from eagle3_pipeline.testing.reporter import Recorder
from eagle3_pipeline.testing.training_data import write_training_data
from eagle3_pipeline.training_data.agreement import ServerEndpoint
from eagle3_pipeline.training_data.reader import TrainingData
from eagle3_pipeline.training_data.serving_reference import record_from_first, record_reference

pytestmark = [pytest.mark.slow, pytest.mark.local_model]

NAME = "SmolLM2-135M-Instruct"
SETTINGS = ServingValidationConfig(samples=4, min_agreement=0.9, near_tie_logprob_margin=0.2)


class LogprobServer:
    """SGLang (``kind='sglang'``) or vLLM (``'vllm'``) on loopback, answering from ``model`` with
    ``tokenizer`` (the served one)."""

    def __init__(self, model: Any, tokenizer: Any, kind: str) -> None:
        self.model, self.tokenizer, self.kind = model, tokenizer, kind
        self.lock = threading.Lock()
        self.requests: list[str] = []

    def top2(self, ids: list[int]) -> Any:
        with self.lock, torch.inference_mode():
            logits = self.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
        return torch.log_softmax(logits, dim=-1).topk(2, dim=-1)

    def answer(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self.requests.append(path)
        if path == "/tokenize":
            return 200, {"tokens": self.tokenizer.encode(body["prompt"], add_special_tokens=False)}
        if path == "/generate" and self.kind == "sglang":
            ids = body["input_ids"]
            top = self.top2(ids)
            rows = [
                [[float(top.values[t, k]), int(top.indices[t, k]), None] for k in range(2)] for t in range(len(ids))
            ]
            return 200, {
                "text": "",
                "meta_info": {"input_top_logprobs": [None, *rows[:-1]], "output_top_logprobs": [rows[-1]]},
            }
        if path == "/v1/completions" and self.kind == "vllm":
            ids = body["prompt"]
            top = self.top2(ids)
            rows = [
                {str(int(top.indices[t, k])): {"logprob": float(top.values[t, k]), "rank": k + 1} for k in range(2)}
                for t in range(len(ids) - 1)
            ]
            return 200, {"choices": [{"text": "", "prompt_logprobs": [None, *rows]}]}
        return 404, {"error": "not found"}

    def __enter__(self) -> LogprobServer:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, payload = owner.answer(self.path, body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


class BrokenTeacher:
    """The real target's states with the teacher taken wrongly (``how``): ``layer_early`` (the final
    norm applied to the output of layer N-2), ``shifted`` (one position late), ``no_final_norm``
    (the last layer's output before the norm)."""

    def __init__(self, target: Target, how: str) -> None:
        self.target, self.how = target, how
        self.identity, self.spot_check_method, self.writer = target.identity, target.spot_check_method, True

    def describe(self) -> str:
        return f"broken teacher ({self.how})"

    def capture(self, aux_layer_ids: Any) -> dict[str, Any]:
        return self.target.capture(aux_layer_ids)

    def share(self, value: Any) -> Any:
        return value

    def batch_states(self, aux_layer_ids: Any, sequences: Any) -> list[tuple[Any, Any]]:
        return [self.reference_states(aux_layer_ids, s) for s in sequences]

    def reference_states(self, aux_layer_ids: Any, sequence: Any) -> tuple[Any, Any]:
        aux, hidden = self.target.reference_states(aux_layer_ids, sequence)
        if self.how == "shifted":
            return aux, hidden.roll(1, dims=0)
        layers, base = decoder_layers(self.target.model), decoder(self.target.model)
        ids = torch.tensor([list(sequence)])
        with torch.inference_mode():
            states = base(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
            caught: dict[str, Any] = {}
            handle = layers[-1].register_forward_hook(
                lambda _m, _i, out: caught.__setitem__("last", out[0] if isinstance(out, tuple) else out)
            )
            base(input_ids=ids, use_cache=False)
            handle.remove()
        if self.how == "layer_early":
            return aux, base.norm(states[-3])[0]
        return aux, caught["last"][0]


@pytest.fixture(scope="module")
def target(local_model: Path) -> Target:
    return load_target(str(local_model), NAME, "cpu", "auto", False)


@pytest.fixture(scope="module")
def tokenizer(local_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(local_model))


def rows_of(tokenizer: Any) -> list[dict[str, Any]]:
    rows = []
    for i, text in enumerate(TEXTS):
        ids = tokenizer.encode(text, add_special_tokens=False)
        mask = [0] * 4 + [1] * (len(ids) - 4)
        rows.append(
            {
                "id": f"s{i:03d}",
                "dataset": "B1",
                "input_ids": ids,
                "loss_mask": mask,
                "num_tokens": len(ids),
                "num_masked": sum(mask),
            }
        )
    return rows


def training_data(folder: Path, tokenizer: Any) -> Path:
    rows = rows_of(tokenizer)
    return write_training_data(folder, {"train": [rows[:3]], "eval": [rows[3:]]})


def spec(data: Path, output: Path, model: Path) -> dict[str, Any]:
    return {
        "training_data": str(data),
        "output": str(output),
        "model": str(model),
        "target_name": NAME,
        "device": "cpu",
        "spot_check_samples": 1,
        "validation": SETTINGS.model_dump(),
        "serving_reference": str(reference_of(data)),
    }


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, target: Target, tokenizer: Any) -> Iterator[Path]:
    """training_data with a reference recorded from the SGLang-like server."""
    data = training_data(tmp_path_factory.mktemp("validated") / "training_data", tokenizer)
    with LogprobServer(target.model, tokenizer, "sglang") as server:
        reference = record_reference(
            data,
            ServerEndpoint(server.base_url, NAME),
            tokenizer=tokenizer,
            tokenizer_name=NAME,
            settings=SETTINGS,
            out=reference_of(data),
        )
    assert reference.api == "sglang" and len(reference.samples) == 4
    assert all(s.tokenization == "same" for s in reference.samples)
    yield data


def test_correct_states_pass_and_the_metadata_says_how_well(recorded: Path, tmp_path: Path, local_model: Path) -> None:
    report = Recorder()
    meta = run(spec(recorded, tmp_path / "store", local_model), report)
    assert meta["serving_validation"] == "passed", meta
    assert meta["serving_samples"] == 4 and meta["serving_positions"] > 60
    assert meta["serving_agreement"] >= 0.95
    assert meta["serving_positions"] + meta["serving_near_ties"] == sum(
        len(r["input_ids"]) - 1 for r in rows_of_folder(recorded)
    )
    assert any("validated against http://127.0.0.1" in line for line in report.lines)
    print(
        f"correct states: {meta['serving_agreement']:.2%} of {meta['serving_positions']} positions, "
        f"{meta['serving_near_ties']} near-ties"
    )


def rows_of_folder(folder: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    data = TrainingData.open(folder)
    return [r for p in data.shard_files("train") + data.shard_files("eval") for r in pq.read_table(p).to_pylist()]


@pytest.mark.parametrize("how", ["layer_early", "shifted", "no_final_norm"])
def test_a_wrong_teacher_stops_the_phase_before_any_shard(
    how: str, recorded: Path, tmp_path: Path, local_model: Path, target: Target
) -> None:
    settings = parse_spec(spec(recorded, tmp_path / "store", local_model))
    data = TrainingData.open(recorded)
    with pytest.raises(ExtractionError) as caught:
        _extract(settings, data, assign_shards(data, settings.shard_tokens), BrokenTeacher(target, how), Recorder())
    message = str(caught.value)
    print(f"{how}: {message}")
    assert "validation against the serving target, before extraction" in message
    assert "below hidden_states.validation.min_agreement 90%" in message and "first disagreements: 's0" in message
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").glob("shard-*"))


def test_vllm_prompt_logprobs_give_the_same_reference_from_the_first_server_that_answers(
    recorded: Path, tmp_path: Path, local_model: Path, target: Target, tokenizer: Any
) -> None:
    data = training_data(tmp_path / "training_data", tokenizer)
    dead = ServerEndpoint("http://127.0.0.1:9/v1", NAME, "sk-not-to-be-logged")
    unreachable = record_from_first(
        data,
        [dead],
        tokenizer_name=str(local_model),
        trust_remote_code=False,
        settings=SETTINGS,
        out=reference_of(data),
    )["serving_reference_status"]
    assert (
        unreachable.startswith("not recorded: http://127.0.0.1:9/generate: ConnectError")
        and "sk-not-to-be-logged" not in unreachable
    )
    assert not reference_of(data).exists()
    with LogprobServer(target.model, tokenizer, "vllm") as server:
        status = record_from_first(
            data,
            [dead, ServerEndpoint(server.base_url, NAME)],
            tokenizer_name=str(local_model),
            trust_remote_code=False,
            settings=SETTINGS,
            out=reference_of(data),
        )
    assert status["serving_reference_status"].startswith(f"recorded from {server.base_url} (vllm): 4 samples")
    assert "sk-not-to-be-logged" not in json.dumps(status) + reference_of(data).read_text()
    vllm = json.loads(reference_of(data).read_text())
    sglang = json.loads(reference_of(recorded).read_text())
    assert vllm["api"] == "vllm" and [s["top1"] for s in vllm["samples"]] == [s["top1"] for s in sglang["samples"]]


def test_rows_of_another_tokenizer_stop_the_phase_with_the_first_differing_token(
    tmp_path: Path, local_model: Path, target: Target, tokenizer: Any
) -> None:
    wrong = other_tokenizer(local_model, tmp_path / "other-tokenizer")
    data = training_data(tmp_path / "training_data", wrong)
    with LogprobServer(target.model, tokenizer, "sglang") as server:
        reference = record_reference(
            data,
            ServerEndpoint(server.base_url, NAME),
            tokenizer=wrong,
            tokenizer_name="other-tokenizer",
            settings=SETTINGS,
            out=reference_of(data),
        )
    assert all("tokenizes the sample's text differently" in s.tokenization for s in reference.samples)
    with pytest.raises(ExtractionError) as caught:
        run(spec(data, tmp_path / "store", local_model), Recorder())
    message = str(caught.value)
    print(f"wrong tokenizer: {message}")
    assert (
        "training_data was tokenized by a tokenizer other than the served model's (other-tokenizer vs http://127.0.0.1"
        in message
    )
    assert "sample 's00" in message and "from token " in message
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").glob("shard-*"))


def test_without_a_reference_the_phase_says_it_did_not_validate(
    tmp_path: Path, local_model: Path, tokenizer: Any
) -> None:
    data = training_data(tmp_path / "training_data", tokenizer)
    report = Recorder()
    meta = run(spec(data, tmp_path / "store", local_model), report)
    assert meta["serving_validation"] == "not validated"
    assert "no reference recorded" in meta["serving_validation_detail"]
    assert any("NOT validated against the serving target" in line for line in report.lines)


def test_against_the_embedded_transformers_serve_the_same_way(
    tmp_path: Path, local_model: Path, target: Target, tokenizer: Any
) -> None:
    """The real embedded server (``transformers serve``, no logprobs, text prompts only): one greedy
    1-token completion per checked prefix; correct states pass, a teacher without the final norm fails."""
    from eagle3_pipeline.inference.embedded import EmbeddedServer

    data = training_data(tmp_path / "training_data", tokenizer)
    settings = SETTINGS.model_copy(update={"text_positions": 6})
    with EmbeddedServer(local_model, tmp_path / "server.log") as server:
        reference = record_reference(
            data,
            ServerEndpoint(server.base_url, server.model),
            tokenizer=tokenizer,
            tokenizer_name=NAME,
            settings=settings,
            out=reference_of(data),
        )
    assert reference.api == "text" and len(reference.samples) == 4
    assert all(
        s.tokenization.startswith("same") and len(s.positions) == 6 and s.margin == [None] * 6
        for s in reference.samples
    )
    meta = run({**spec(data, tmp_path / "store", local_model), "validation": settings.model_dump()}, Recorder())
    assert meta["serving_validation"] == "passed" and meta["serving_agreement"] >= 0.9, meta
    assert (
        meta["serving_near_ties_known"] is False and meta["serving_positions"] + meta["serving_unknown_positions"] == 24
    )
    print(
        f"embedded: {meta['serving_agreement']:.2%} of {meta['serving_positions']} positions, "
        f"{meta['serving_unknown_positions']} not one token"
    )
    parsed = parse_spec({**spec(data, tmp_path / "broken", local_model), "validation": settings.model_dump()})
    opened = TrainingData.open(data)
    with pytest.raises(
        ExtractionError,
        match=r"validation against the serving target, before extraction: .*\(http://127\.0\.0\.1:\d+/v1, text\)",
    ):
        _extract(
            parsed,
            opened,
            assign_shards(opened, parsed.shard_tokens),
            BrokenTeacher(target, "no_final_norm"),
            Recorder(),
        )


def test_the_hidden_states_asset_reports_the_agreement_as_its_check(
    tmp_path: Path, local_model: Path, target: Target, tokenizer: Any
) -> None:
    """The asset on a real Dagster instance: the reference recorded while the (SGLang-like) server was
    up is kept by the preflight, the phase validates first, the check reports the agreement."""
    import dagster as dg

    from eagle3_pipeline.components.eagle3.hidden_states import build_eagle3_assets
    from eagle3_pipeline.config import load_config
    from eagle3_pipeline_tests.dagster_runs import pipeline_resources
    from eagle3_pipeline_tests.pipeline_files import TINY_TARGET, write_pipeline

    hidden_states = {"shard_tokens": 200, "spot_check_samples": 1, "device": "cpu", "validation": {"samples": 2}}
    path = write_pipeline(tmp_path, TINY_TARGET, {"hidden_states": hidden_states})
    config = load_config(path)
    data = training_data(config.artifacts_root / "training_data", tokenizer)
    with LogprobServer(target.model, tokenizer, "sglang") as server:
        record_reference(
            data,
            ServerEndpoint(server.base_url, NAME),
            tokenizer=tokenizer,
            tokenizer_name=NAME,
            settings=config.hidden_states.validation,
            out=reference_of(data),
        )
    assets = build_eagle3_assets(config)
    result = dg.materialize(
        assets, selection=["hidden_states"], instance=dg.DagsterInstance.ephemeral(), resources=pipeline_resources(path)
    )
    assert result.success
    [check] = [e for e in result.get_asset_check_evaluations() if e.check_name == "serving_agreement"]
    assert (
        check.passed
        and "against http://127.0.0.1" in (check.description or "")
        and "(sglang, SmolLM2-135M-Instruct)" in (check.description or "")
    )
    meta: dict[str, Any] = {
        k: v.value for k, v in result.asset_materializations_for_node("hidden_states")[0].metadata.items()
    }
    assert meta["serving_reference_status"].startswith("kept: recorded earlier for these rows")
    assert meta["serving_samples"] == 2 and meta["serving_agreement"] >= 0.95


def test_a_kimi_shaped_target_validates_with_its_lm_head_read_by_name(tmp_path: Path, kimi_checkpoint: Path) -> None:
    """The tiny Kimi-K2.5 stand-in (remote code, nested text config, ``language_model.lm_head`` in
    shards, TikToken tokenizer). Its random weights put every top-2 margin under 0.2 nats, so the
    near-tie margin is 0.001 here; a teacher shifted by a position still fails."""
    kimi = load_target(str(kimi_checkpoint), "kimi-k2.5", "cpu", "auto", True)
    tokenizer = load_tokenizer(str(kimi_checkpoint), trust_remote_code=True)
    data = training_data(tmp_path / "training_data", tokenizer)
    settings = SETTINGS.model_copy(update={"near_tie_logprob_margin": 0.001})
    with LogprobServer(language_model(kimi.model), tokenizer, "sglang") as server:
        reference = record_reference(
            data,
            ServerEndpoint(server.base_url, "kimi-k2.5"),
            tokenizer=tokenizer,
            tokenizer_name=str(kimi_checkpoint),
            settings=settings,
            out=reference_of(data),
        )
    assert all(s.tokenization == "same" for s in reference.samples)
    kimi_spec = {
        **spec(data, tmp_path / "store", kimi_checkpoint),
        "target_name": "kimi-k2.5",
        "trust_remote_code": True,
        "aux_layer_ids": [1, 2, 3],
        "validation": settings.model_dump(),
    }
    meta = run(kimi_spec, Recorder())
    assert (
        meta["serving_validation"] == "passed" and meta["serving_agreement"] >= 0.95 and meta["serving_positions"] > 50
    ), meta
    print(
        f"kimi: {meta['serving_agreement']:.2%} of {meta['serving_positions']} positions, "
        f"{meta['serving_near_ties']} near-ties"
    )
    parsed = parse_spec({**kimi_spec, "output": str(tmp_path / "broken")})
    opened = TrainingData.open(data)
    with pytest.raises(
        ExtractionError,
        match=r"before extraction: argmax\(lm_head\(teacher\)\) agrees .* below hidden_states.validation.min_agreement",
    ):
        _extract(parsed, opened, assign_shards(opened, parsed.shard_tokens), BrokenTeacher(kimi, "shifted"), Recorder())
