"""`hidden_states` (group ``eagle3``): EAGLE-3 phase A, the heavy phase ``extract``
(eagle3_pipeline.hidden_states.extract:run) through ``run_heavy_phase``, wherever ``compute:`` says; with
``compute: command`` the user's command then ``import-specforge``. Checks from the phase's metadata:
spot_check, serving_agreement, bytes_per_token. :func:`build_eagle3_assets` returns it with `draft_vocab`
(:mod:`.draft_vocab`), the other asset the phase's group holds.

What is shipped to a GPU host and what comes back: docs/scaling.md, "Where heavy phases run"; who holds
the GPUs during the phase (the extraction server, or none): docs/operations.md, "Managed servers in a run".
"""

from collections.abc import Mapping
from typing import Any

import dagster as dg

from eagle3_pipeline.components.eagle3.draft_vocab import GROUP, build_draft_vocab_assets, training_data_checks
from eagle3_pipeline.components.fit import fitted
from eagle3_pipeline.components.managed import OwnLaunch, hand_over
from eagle3_pipeline.components.policy import step_policy
from eagle3_pipeline.components.resources import StepResources
from eagle3_pipeline.compute.remote import RemoteError
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.hidden_states.extract import ExtractionError, nothing_to_do, spec_from_config, target_weights
from eagle3_pipeline.hidden_states.sharding import ROLLING_LAYOUT_FILE
from eagle3_pipeline.hidden_states.store import StoreError, bytes_per_token_check
from eagle3_pipeline.hidden_states.validation import ServingReferenceError, preflight_reference
from eagle3_pipeline.hidden_states.vllm_server import extraction_purpose, managed_extraction_server
from eagle3_pipeline.hosts import HostError
from eagle3_pipeline.inference.provider import tokenizer_name
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.managed import ServerSetup
from eagle3_pipeline.orchestration.gating import require_passing_checks
from eagle3_pipeline.orchestration.heavy_phase import run_heavy_phase, under_root
from eagle3_pipeline.orchestration.names import DEFAULT_NAMES, PipelineNames
from eagle3_pipeline.results import HiddenStatesResult
from eagle3_pipeline.target.folder import TargetError
from eagle3_pipeline.training_data.reader import TrainingDataError

BYTES_PER_TOKEN_TOLERANCE = 0.05
PHASE_ERRORS = (
    ExtractionError,
    StoreError,
    TrainingDataError,
    TargetError,
    RemoteError,
    HostError,
    ServingReferenceError,
)
STORE_FILES = ("index.parquet", "manifest.json")


def _as_recorded(meta: Mapping[str, Any]) -> str:
    """A check of a run that found the store complete: its figures are the completing run's."""
    return f" (as recorded when the store was completed, {meta['completed_at']})" if "completed_at" in meta else ""


def _spot_check_result(meta: Mapping[str, Any]) -> dg.AssetCheckResult:
    if "spot_check_passed" not in meta:
        return dg.AssetCheckResult(
            check_name="spot_check",
            passed=False,
            severity=dg.AssetCheckSeverity.WARN,
            description="not run: the states were imported from compute.command's output, not extracted with "
            "transformers "
            f"(input_ids checked against training_data; {meta.get('loss_mask_disagreements', 0)} loss-mask "
            "disagreement(s))",
        )
    return dg.AssetCheckResult(
        check_name="spot_check",
        passed=bool(meta["spot_check_passed"]),
        description=f"{meta['spot_check_samples']} samples re-computed {meta['spot_check_method']}, max relative error "
        f"{meta['spot_check_max_rel_error']:.2e} (tolerance {meta['spot_check_tolerance']}; worst "
        f"{meta['spot_check_worst_sample'] or '-'}){_as_recorded(meta)}",
    )


def _serving_agreement_result(meta: Mapping[str, Any]) -> dg.AssetCheckResult:
    """Passed only when the phase compared the states with the serving target; a phase that saw no
    reference (or imported the states) reports that it did not validate, as a failing WARN."""
    status = meta.get("serving_validation")
    if status == "passed":
        near = (
            f"; near-ties apart: {meta['serving_near_ties']}"
            if meta["serving_near_ties_known"]
            else "; near-ties unknown (no logprobs)"
        )
        return dg.AssetCheckResult(
            check_name="serving_agreement",
            passed=True,
            description="argmax(lm_head(teacher)) = the serving target's greedy token at "
            f"{meta['serving_agreement']:.1%} of "
            f"{meta['serving_positions']} positions of {meta['serving_samples']} samples (floor "
            f"{meta['serving_min_agreement']:.0%}) "
            f"against {meta['serving_reference']}{near}{_as_recorded(meta)}",
            metadata={
                k: meta[k] for k in ("serving_agreement", "serving_positions", "serving_samples", "serving_near_ties")
            },
        )
    detail = (
        meta.get("serving_validation_detail")
        or "the states were imported from compute.command's output, not extracted by the phase"
    )
    return dg.AssetCheckResult(
        check_name="serving_agreement",
        passed=False,
        severity=dg.AssetCheckSeverity.WARN,
        description=f"not validated against the serving target: {detail}{_as_recorded(meta)}",
    )


def extract_launch(config: PipelineConfig) -> dict[str, Any]:
    """How the `extract` worker starts for ``hidden_states.backend: sglang``: ``tp_size`` torchrun
    ranks with SGLang's venv python, that many free GPUs on the host. ``compute.kind: command``
    extracts with the user's command instead, and ``backend: transformers`` needs nothing more."""
    settings = config.hidden_states
    if settings.backend != "sglang" or config.compute.kind == "command":
        return {}
    assert settings.sglang_python is not None  # HiddenStatesConfig requires it with backend sglang
    return {
        "processes": settings.tp_size,
        "python": (settings.sglang_python, "hidden_states.sglang_python"),
        "gpus": (settings.tp_size, "hidden_states.tp_size"),
    }


def extraction_of(config: PipelineConfig, server: ServerSetup) -> OwnLaunch:
    """The managed extraction server serving the store, its purpose built on its host once the host is connected."""
    return OwnLaunch(
        server,
        lambda supervisor: extraction_purpose(config.hidden_states, config.source_file, server, supervisor.server.host),
    )


def hidden_states(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    resources = StepResources.of_asset(context)
    names = resources.names
    config = fitted(context, resources.config(), "hidden_states")
    layout = ArtifactLayout(config.artifacts_root)
    require_passing_checks(context.instance, training_data_checks(names))
    rolling = [ROLLING_LAYOUT_FILE] if config.hidden_states.rolling_window_shards is not None else []
    fetch = [f"{layout.hidden_states.name}/{name}" for name in (*STORE_FILES, *rolling)]
    try:
        model = target_weights(config)
        spec = spec_from_config(
            config.hidden_states, config.target, str(layout.training_data), str(layout.hidden_states), model
        )

        def record_reference() -> dict[str, Any]:
            reference = preflight_reference(
                config,
                layout.training_data,
                tokenizer_name(config.target, config.inference, config.source_file),
                layout.serving_reference,
            )
            context.log.info(f"serving reference: {reference['serving_reference_status']}")
            return reference

        def extract() -> dict[str, Any]:
            recorded = layout.serving_reference.is_file()
            spec["serving_reference"] = str(layout.serving_reference) if recorded else None
            ship = [str(layout.training_data), *([str(layout.serving_reference)] if recorded else [])]
            ship += [model] if under_root(model, layout.root) else []
            return run_heavy_phase(
                context,
                config.compute,
                artifacts_root=config.artifacts_root,
                phase="extract",
                spec=spec,
                ship=ship,
                fetch=fetch,
                **extract_launch(config),
            )

        server = managed_extraction_server(config)
        own = extraction_of(config, server) if server is not None else None
        if nothing_to_do(spec):  # a complete store opens no state source: no server, no GPU
            reference = {"serving_reference_status": "not needed: the store is complete for these settings"}
            context.log.info(f"serving reference: {reference['serving_reference_status']}")
            meta = extract()
        elif own is not None and config.compute.kind == "local":
            # the reference from the extraction server itself, as from one the user started
            with hand_over(context, config, names, "hidden_states", own):
                reference = record_reference()
                meta = extract()
        else:
            reference = record_reference()  # from the serving target while it still serves
            with hand_over(context, config, names, "hidden_states", own):
                meta = extract()
    except PHASE_ERRORS as exc:
        raise dg.Failure(description=str(exc)) from None
    passed, text = bytes_per_token_check(
        meta["bytes_per_token"],
        meta["target_hidden_size"],
        len(meta["aux_layer_ids"]),
        config.hidden_states.storage_dtype,
        BYTES_PER_TOKEN_TOLERANCE,
    )
    checks = [
        _spot_check_result(meta),
        _serving_agreement_result(meta),
        dg.AssetCheckResult(check_name="bytes_per_token", passed=passed, description=text),
    ]
    result = HiddenStatesResult.from_metadata({**meta, **reference})
    resources.listener.result("hidden_states", None, result)
    metadata = {
        **result.as_metadata(),
        "store": dg.MetadataValue.path(result.store),
        "aux_layer_ids": str(result.aux_layer_ids),
    }
    return dg.MaterializeResult(metadata=metadata, check_results=checks)


def build_eagle3_assets(
    loaded: PipelineConfig, names: PipelineNames = DEFAULT_NAMES
) -> list[dg.AssetsDefinition | dg.AssetChecksDefinition]:
    """`draft_vocab` with its check, then `hidden_states`; `loaded` (the file at load) words the descriptions;
    bodies read the pipeline's settings resource (key `names.pipeline`)."""
    training_data = names.key("training_data")

    hidden_states_asset = dg.asset(
        key_prefix=names.key_prefix,
        group_name=names.name(GROUP),
        kinds={"safetensors", "parquet"},
        deps=[training_data],
        required_resource_keys={names.pipeline, names.phase_listener},
        check_specs=[
            dg.AssetCheckSpec(
                "spot_check",
                asset=names.key("hidden_states"),
                blocking=True,
                description="Sampled sequences re-computed alone (transformers: the whole causal LM with "
                "output_hidden_states, no padding; sglang: one request per forward through the same runner; "
                "vllm: the same "
                "request sent again to the server) "
                "match the stored states within hidden_states.spot_check_tolerance.",
            ),
            dg.AssetCheckSpec(
                "serving_agreement",
                asset=names.key("hidden_states"),
                blocking=True,
                description="Before the extraction, hidden_states.validation.samples samples re-computed through the "
                "state source: every state finite and of the manifest's shape, argmax(lm_head(teacher)) equal to the "
                "serving server's greedy token at ≥ hidden_states.validation.min_agreement of the positions (near-ties "
                "apart), the server's tokenization of the text equal to ours; the phase refuses to extract otherwise. "
                "No reference recorded (no server was up): a failing WARN, not a pass.",
            ),
            dg.AssetCheckSpec(
                "bytes_per_token",
                asset=names.key("hidden_states"),
                description="Bytes on disk per token within 5 % of the formula for hidden_states.storage_dtype: "
                "(3 aux + teacher) × hidden × 2 + 5 in bfloat16, (3 aux + teacher) × (hidden + 4) + 5 in float8_e4m3.",
            ),
        ],
        description="The target's hidden states for every train and eval sample: 3 aux layers (output-of-layer ids) "
        "and the teacher (final hidden state after the final norm), safetensors shards (bf16, or fp8 "
        "with per-token scales: "
        "hidden_states.storage_dtype) + Parquet index.",
        **step_policy(loaded, "hidden_states"),
    )(hidden_states)

    return [*build_draft_vocab_assets(loaded, names), hidden_states_asset]
