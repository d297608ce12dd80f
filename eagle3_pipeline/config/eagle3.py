"""`training_data:`, `draft_vocab:` and `hidden_states:` the rows, the draft vocabulary and the target's states."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from eagle3_pipeline.config.base import ConfigModel, HttpUrl


class TrainingDataConfig(ConfigModel):
    """How responses become training shards (see eagle3_pipeline.training_data).

    ``reasoning``: see its field description. ``max_template_mismatch_rate``: the share
    of conversations whose generated turns the template cannot render faithfully (the blocking check
    ``training_data:template_mismatch_rate`` fails above it). ``buffer_rows``: conversations tokenized
    per batch and held per sort bucket, which bounds memory whatever the number of rows."""

    eval_fraction: Annotated[float, Field(ge=0, lt=1)] = Field(
        default=0.05,
        description="The eval share, by a hash of the id (independent of the prompt sample's).",
    )
    shard_rows: Annotated[int, Field(gt=0)] = Field(default=10_000, description="Rows per shard.")
    reasoning: Literal["emit", "render", "drop"] = Field(
        default="emit",
        description=(
            "emit: the response is the prompt as the server rendered it for generation followed by what the target "
            "emitted (its reasoning in its own thinking markup, content, tool calls, end of turn), masked; render: the "
            "template's history render of the turn (Kimi-K2.5's blanks the reasoning); drop: reasoning left out."
        ),
    )
    max_template_mismatch_rate: Annotated[float, Field(ge=0, le=1)] = Field(
        default=0.01,
        description=(
            "The share of conversations whose generated turns the template cannot render faithfully (they are left "
            "out and counted); the blocking check training_data:template_mismatch_rate fails above it."
        ),
    )
    tokenizer_check_samples: Annotated[int, Field(ge=0)] = Field(
        default=8,
        description=(
            "Before the rows are built, this many rendered conversations are tokenized locally and by the first "
            "serving endpoint with a tokenize route (SGLang and vLLM: POST /tokenize); a disagreement fails the phase "
            "with the first differing token. No endpoint to ask: recorded as not checked. 0: off."
        ),
    )
    buffer_rows: Annotated[int, Field(gt=0)] = Field(
        default=4096,
        description=(
            "Conversations tokenized per batch and held per sort bucket: memory is bounded by this and shard_rows, "
            "whatever the number of rows."
        ),
    )
    held_out_per_dataset: Annotated[int, Field(ge=0)] = Field(
        default=0,
        description=(
            "Per dataset, this many samples (the smallest sha256('held_out:{seed}:{id}'), at most half the dataset's "
            "rows) are "
            "forced into the eval split, never trained on, and recorded in training_data's manifest.json (held_out); "
            "drafter_eval reports τ on them apart. The same ids every run for the same prompts and seed. 0: none."
        ),
    )


class DraftVocabConfig(ConfigModel):
    """`draft_vocab:` the target ids the drafter predicts, chosen by masked-token frequency."""

    size: Annotated[int, Field(gt=0)] | None = Field(
        default=None,
        description=(
            "Target ids the drafter predicts (the most frequent loss-masked ones of the train split); default: a "
            "quarter of the target vocabulary, at least 1024 (draft_vocab.default_draft_vocab_size)."
        ),
    )
    target_vocab_size: Annotated[int, Field(gt=0)] | None = Field(
        default=None,
        description=(
            "Rows of the target's lm_head; default: training_data's vocab_size (the tokenizer's length). Set it "
            "when the target pads its embedding matrix beyond the tokenizer."
        ),
    )
    min_coverage: Annotated[float, Field(ge=0, le=1)] = Field(
        default=0.9,
        description="The blocking check draft_vocab:coverage fails below this share of masked train tokens covered.",
    )


class ServingValidationConfig(ConfigModel):
    """`hidden_states.validation:` the states checked against the serving target before a large extraction."""

    samples: Annotated[int, Field(ge=0)] = Field(
        default=8,
        description=(
            "How many training_data samples (the ones with the smallest SHA-256 of their id) the serving server is "
            "asked "
            "about while it is up (training_data time, or the hidden_states preflight): per position its greedy next "
            "token "
            "and, where it gives logprobs, the top-2 margin; plus its own tokenization of the sample's text. The "
            "extract "
            "phase computes the same samples through its state source first and compares argmax(lm_head(teacher)) with "
            "the server's token before the large extraction starts. 0: off (the serving_agreement check then reports "
            "'not validated')."
        ),
    )
    min_agreement: Annotated[float, Field(ge=0, le=1)] = Field(
        default=0.9,
        description=(
            "Share of the compared positions (near-ties left out) where argmax(lm_head(teacher)) must equal the "
            "server's "
            "greedy token; below it the extract phase refuses to start and names the samples and positions."
        ),
    )
    near_tie_logprob_margin: Annotated[float, Field(ge=0)] = Field(
        default=0.2,
        description=(
            "A position whose server top-1 and top-2 logprobs differ by less than this (nats) is a near-tie: numerics "
            "(bf16 states, the server's kernels and quantization) may flip it, so it is reported apart and not "
            "counted in "
            "the agreement. Unknown where the server gives no logprobs (the embedded server)."
        ),
    )
    max_positions: Annotated[int, Field(gt=0)] = Field(
        default=256,
        description=(
            "Positions compared per sample (the first ones) where the server answers every position in one request "
            "(SGLang, vLLM)."
        ),
    )
    text_positions: Annotated[int, Field(gt=0)] = Field(
        default=16,
        description=(
            "Positions compared per sample against a server that only completes text (the embedded transformers "
            "serve): one greedy 1-token completion of the decoded prefix each, so fewer."
        ),
    )
    timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=120.0, description="Timeout of each request to the serving server."
    )


class HiddenStatesConfig(ConfigModel):
    """`hidden_states:` how the target's states are extracted (the `extract` phase's settings)."""

    model: str | None = Field(
        default=None,
        description=(
            "The target's weights as transformers loads them (a folder or a Hugging Face id, on the machine where "
            "extraction runs). Default: the embedded model, or target.tokenizer for endpoints."
        ),
    )
    aux_layer_ids: list[int] | None = Field(
        default=None,
        description=(
            "Three increasing output-of-layer ids of the aux layers (id i: the output of layer i); default "
            "[1, N/2-1, N-4] for an N-layer target, the layers SGLang and vLLM capture by default as [2, N/2, N-3]."
        ),
    )
    shard_tokens: Annotated[int, Field(gt=0)] = Field(
        default=32768,
        description="Tokens per store shard (never spanning two training_data shards); memory: this × bytes per token.",
    )
    batch_tokens: Literal["auto"] | Annotated[int, Field(gt=0)] = Field(
        default=8192,
        description=(
            "Padded tokens per forward pass (right-padded batches of length-sorted samples). auto (backend sglang): "
            "the largest of 32768…2048 that SGLang's KV pool and the memory beside it hold on the GPUs found at the "
            "phase's preflight (eagle3_pipeline.fit); elsewhere auto is 8192."
        ),
    )
    max_batch_size: Annotated[int, Field(gt=0)] = Field(default=32, description="Rows per forward pass.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="auto: CUDA (device_map auto) when torch sees a GPU, else the CPU."
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="The compute dtype; auto: bfloat16 on CUDA, float32 on the CPU."
    )
    disk_margin: Annotated[float, Field(gt=0)] = Field(
        default=1.2, description="Refuse to start when free disk < estimated bytes still to write × disk_margin."
    )
    overwrite: bool = Field(
        default=False, description="Replace a store made under other settings instead of refusing it."
    )
    spot_check_samples: Annotated[int, Field(ge=0)] = Field(
        default=4,
        description=(
            "Stored samples (the ids with the smallest SHA-256) re-computed alone after extraction and compared "
            "(the blocking check hidden_states:spot_check)."
        ),
    )
    spot_check_tolerance: Annotated[float, Field(gt=0)] | None = Field(
        default=None,
        description=(
            "Largest relative L2 error (per sample and tensor, bf16) between stored and re-computed states. null: "
            "0.01 for transformers and sglang (bf16 storage alone gives ~5e-4 on CPU float32), 0.1 for vllm (its "
            "bf16 kernels round a sample computed in another batch differently: measured up to 1.6 % on the "
            "teacher and 4.9 % on layer N, CPU build; a state of another token or sample is > 100 % off)."
        ),
    )
    storage_dtype: Literal["bfloat16", "float8_e4m3"] = Field(
        default="bfloat16",
        description=(
            "How the store holds the aux layers and the teacher. bfloat16: 2 bytes per value ((3+1)·H·2 + 5 bytes per "
            "token; "
            "Kimi-K2.5: 57,349). float8_e4m3: 1 byte per value plus a float32 scale per token and layer ((3+1)·(H+4) "
            "+ 5; "
            "Kimi-K2.5: 28,693), about half the disk; every reader dequantizes to bf16 "
            "(eagle3_pipeline.hidden_states.store). "
            "Part of the store's identity: a store of the other dtype is refused (or replaced with overwrite), never "
            "reused. "
            "The spot check compares the stored states with the re-computed ones rounded the same way."
        ),
    )
    backend: Literal["transformers", "sglang", "vllm"] = Field(
        default="transformers",
        description=(
            "What computes the states. transformers: the target in this process (or in the worker on the GPU host) "
            "with "
            "transformers, device_map across the visible GPUs. sglang: SGLang's own model runner in process, with "
            "tensor "
            "parallelism (tp_size ranks under torchrun, started with sglang_python), fed our input_ids, aux layers "
            "captured "
            "through SGLang's EAGLE-3 switch (set_eagle3_layers_to_capture): for a target only SGLang can hold "
            "(Kimi-K2.5 "
            "INT4 at tp 8). The worker is written against sglang 0.5.14 and sglang 0.5.23 (the release found in "
            "sglang_python's venv; eagle3_pipeline.hidden_states.sglang_api.RELEASES) and refuses another version. "
            "The phase needs the GPUs the inference server holds: a managed server (serving.managed) on that machine "
            "is stopped for it and brought back when generation work remains; an unmanaged one must be stopped first. "
            "vllm: a vLLM server started with the extract_hidden_states speculative method and its "
            "ExampleHiddenStatesConnector "
            "(vllm_base_url, vllm_output_dir; eagle3_pipeline.hidden_states.vllm_capture); the phase sends it our "
            "input_ids. A managed vLLM server (serving.managed, engine vllm) is that server: the pipeline starts it "
            "with the store's layer ids."
        ),
    )
    vllm_base_url: HttpUrl | None = Field(
        default=None,
        description=(
            "backend vllm: the OpenAI-compatible base URL (…/v1) of a vLLM server already started with "
            "--speculative-config method extract_hidden_states (the aux layers' ids + 1 and num_hidden_layers), the "
            "ExampleHiddenStatesConnector as --kv-transfer-config, --no-enable-chunked-prefill and "
            "--no-enable-prefix-caching, on the machine where extraction runs (the phase reads the ids the server was "
            "started with from its command line there, and refuses other ids or none, naming the flags to start it "
            "with; requests name the model it serves, GET /v1/models). Required with backend vllm; with a managed "
            "vLLM server (serving.managed) it defaults to that server's URL, and the pipeline starts it with those "
            "ids itself."
        ),
    )
    vllm_output_dir: Annotated[str, Field(min_length=1)] | None = Field(
        default=None,
        description=(
            "backend vllm: the folder the connector writes to (its shared_storage_path), as seen on the machine where "
            "extraction runs; each request's file is read there and deleted once read. Required with backend vllm; "
            "with a managed vLLM server it defaults to vllm_connector under the artifacts root where extraction runs."
        ),
    )
    sglang_python: Annotated[str, Field(min_length=1)] | None = Field(
        default=None,
        description=(
            "backend sglang: the python of the SGLang venv where extraction runs (the GPU host for compute "
            "ssh/command, "
            "this machine for compute local), with sglang==0.5.14 or sglang==0.5.23 and this package installed (e.g. "
            "/opt/sglang/.venv/bin/python). "
            "Required with backend sglang."
        ),
    )
    tp_size: Annotated[int, Field(ge=1)] = Field(
        default=8,
        description=(
            "backend sglang: tensor-parallel ranks (GPUs, one torchrun process each); 8 as the target is served "
            "(Kimi-K2.5: --tp-size 8). With compute ssh/command that many GPUs must be free on the host."
        ),
    )
    mem_fraction_static: Literal["auto"] | Annotated[float, Field(gt=0, lt=1)] = Field(
        default="auto",
        description=(
            "backend sglang: share of each GPU's memory for weights and the KV pool (SGLang's --mem-fraction-static). "
            "auto: chosen at the phase's preflight from the checkpoint and the GPUs found (eagle3_pipeline.fit): the "
            "rest holds one prefill of batch_tokens, the pool the rest (`eagle3-pipeline plan` shows the choice). A "
            "number is kept, and refused with the figures when the weights and one batch cannot fit in it."
        ),
    )
    rolling_window_shards: Literal["auto"] | Annotated[int, Field(gt=0)] | None = Field(
        default=None,
        description=(
            "Rolling mode, for a store larger than the disk (null: off, the whole store is extracted once; auto: off "
            "when the whole store fits the free disk found at hidden_states' preflight, else the largest N it holds, "
            "and afterwards whatever the store was extracted with — eagle3_pipeline.fit). With N, "
            "hidden_states extracts only the eval shards (drafter_eval reads them) and records the train shards' "
            "layout; "
            "eagle3_drafter then, per epoch and per window of N train shards (shard_tokens each): extracts the window, "
            "trains on its rows, checkpoints, records the window done (<drafter run>/rolling.json) and deletes it. "
            "Disk "
            "peak: the eval shards + one window. Each epoch re-extracts every train token: extraction time × "
            "drafter.epochs "
            "and one target load per window: pick the largest N the disk holds (benchmarks/rolling_tradeoff.py prints "
            "the figures). "
            "compute.kind command is not supported."
        ),
    )
    validation: ServingValidationConfig = Field(
        default_factory=ServingValidationConfig,
        description="The check of the states against the serving target before a large extraction (see its fields).",
    )

    @field_validator("aux_layer_ids")
    @classmethod
    def _three_increasing_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and (len(ids) != 3 or ids != sorted(set(ids)) or ids[0] < 0):
            raise ValueError(f"expected 3 increasing non-negative layer ids, got {ids}")
        return ids

    @model_validator(mode="after")
    def _vllm_settings(self) -> HiddenStatesConfig:
        if self.backend == "vllm" and (self.vllm_base_url is None or self.vllm_output_dir is None):
            raise ValueError(
                "backend 'vllm' needs hidden_states.vllm_base_url (the …/v1 URL of a vLLM server started with "
                "extract_hidden_states) and hidden_states.vllm_output_dir (its connector's shared_storage_path, as "
                "seen here), or a managed vLLM server (serving.managed with engine vllm), which the pipeline starts"
            )
        return self

    @model_validator(mode="after")
    def _sglang_settings(self) -> HiddenStatesConfig:
        if self.backend != "sglang":
            return self
        if self.sglang_python is None:
            raise ValueError(
                "backend 'sglang' needs hidden_states.sglang_python: the python of the venv with sglang==0.5.14 or "
                "0.5.23 and "
                "this "
                "package, on the machine where extraction runs"
            )
        if self.device == "cpu":
            raise ValueError(
                "device 'cpu' is for backend 'transformers'; backend 'sglang' runs on the GPUs (device: auto or cuda)"
            )
        return self
