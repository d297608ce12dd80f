"""The `eagle3_drafter` asset: train the EAGLE-3 drafter on the hidden states and export it.

Asset → domain function: eagle3_drafter → eagle3_pipeline.drafter.train.phase:run (the ``train`` phase),
through `run_heavy_phase` wherever `compute:` says (for `command` too: the user command replaces
only extraction). On a GPU host the draft_vocab folder is shipped, the hidden states are already
there (phase A left them under the host's artifacts root), a warm start's folder (`drafter.init_from`)
is shipped when it lies under the artifacts root, the checkpoints and the export stay on the host,
and only the export's config.json and the run's tau_curve.json (τ against the training tokens seen,
which `drafter_eval` and `eagle3-pipeline plan` read) come back. `drafter.target_weights` and
`drafter.init_from` are then paths on the host.

With `hidden_states.rolling_window_shards` the asset runs the rolling loop
(eagle3_pipeline.drafter.train.rolling:run_rolling) over the windows the hidden_states phase recorded; its
three steps are the same heavy phases through `run_heavy_phase`: `extract` of a window's shards,
`train` of that window, `extract` deleting the window's shards. Its state (`rolling.json`) lies
beside the drafter's run folder on this machine.

A managed server (`serving.managed`) on the machine where training runs is stopped for it and comes back as
the generation server while `responses` partitions are incomplete (eagle3_pipeline.components.managed:hand_over);
in the rolling loop a managed extraction server serves each window's extraction and is stopped for its
training.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from eagle3_pipeline.components.eagle3.drafter_eval import input_checks
from eagle3_pipeline.components.eagle3.hidden_states import extract_launch
from eagle3_pipeline.components.fit import fitted
from eagle3_pipeline.components.managed import hand_over
from eagle3_pipeline.components.policy import step_policy
from eagle3_pipeline.components.resources import StepResources
from eagle3_pipeline.compute.remote import RemoteError
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.drafter.evaluate.scaling import TAU_CURVE_FILE
from eagle3_pipeline.drafter.spec import DrafterSpecError, drafter_paths, train_spec
from eagle3_pipeline.drafter.train.rolling import STATE_FILE, RollingError, run_rolling
from eagle3_pipeline.hidden_states.extract import ExtractionError, spec_from_config
from eagle3_pipeline.hidden_states.extract import target_weights as extract_target
from eagle3_pipeline.hidden_states.sharding import read_rolling_layout
from eagle3_pipeline.hidden_states.store import StoreError
from eagle3_pipeline.hidden_states.vllm_server import extraction_purpose, managed_extraction_server
from eagle3_pipeline.hosts import HostError
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.managed import Supervisor
from eagle3_pipeline.orchestration.gating import require_passing_checks
from eagle3_pipeline.orchestration.heavy_phase import DagsterReporter, run_heavy_phase, under_root
from eagle3_pipeline.orchestration.names import DEFAULT_NAMES, PipelineNames
from eagle3_pipeline.results import DrafterResult


def _table(rows: Sequence[Mapping[str, Any]]) -> dg.MetadataValue:
    columns = list(rows[0]) if rows else ["step"]
    return dg.MetadataValue.table(
        records=[dg.TableRecord({c: float(row.get(c, float("nan"))) for c in columns}) for row in rows],
        schema=dg.TableSchema(columns=[dg.TableColumn(c, "float") for c in columns]),
    )


BAR_WIDTH = 24
SPARKS = "▁▂▃▄▅▆▇█"


def checkpoint_chart(rows: Sequence[Mapping[str, Any]], key: str, exported: int | None, start: float | None) -> str:
    """Markdown a person reads at a glance in one materialization (Dagster plots numbers only across
    materializations): a sparkline of ``key`` over the checkpoints, then one bar per checkpoint, scaled
    from the lowest to the highest value shown, the exported one marked; the warm start's value first."""
    points = ([("start", start)] if start is not None else []) + [(str(int(r["step"])), float(r[key])) for r in rows]
    if not points:
        return f"no evaluated checkpoint ({key})"
    low, high = min(v for _, v in points), max(v for _, v in points)
    span = high - low

    def scaled(value: float, top: int) -> int:
        return top if span == 0 else round((value - low) / span * top)

    spark = "".join(SPARKS[scaled(v, len(SPARKS) - 1)] for _, v in points)
    lines = [f"{key} by checkpoint: `{spark}` ({low:.3f} – {high:.3f})", "", f"| step | {key} | |", "|---:|---:|:---|"]
    for step, value in points:
        bar = "█" * (1 + scaled(value, BAR_WIDTH - 1))
        mark = " ◀ exported" if exported is not None and step == str(exported) else ""
        lines.append(f"| {step} | {value:.3f} | `{bar.ljust(BAR_WIDTH, '░')}`{mark} |")
    return "\n".join(lines)


def selection_metadata(result: Mapping[str, Any]) -> dict[str, Any]:
    """The exported checkpoint (``drafter.select``) and τ at the depth it was chosen by for every
    evaluated checkpoint: a table (with the per-depth acceptance and which one was exported), the
    same curve as a series, and as a chart (:func:`checkpoint_chart`); nothing for a run that exported nothing."""
    selected = result.get("selected")
    if not selected:
        return {}
    key = f"tau@{selected['select_steps']}"
    rows = [
        {"step": e["step"], key: e[key], **{k: v for k, v in e.items() if k.startswith("accept_")},
         "exported": float(e["step"] == selected["step"])}
        for e in result["evals"] if key in e
    ]  # fmt: skip
    start = (result.get("start") or {}).get(key)
    return {
        "selected": dg.MetadataValue.json(selected),
        "tau_by_checkpoint": _table(rows),
        "tau_by_checkpoint_series": dg.MetadataValue.json(
            {"x": "step", "y": key, "step": [r["step"] for r in rows], key: [round(r[key], 4) for r in rows]}
        ),
        "tau_by_checkpoint_chart": dg.MetadataValue.md(checkpoint_chart(rows, key, selected["step"], start)),
    }


def start_metadata(result: Mapping[str, Any]) -> dict[str, Any]:
    """A warm start (``drafter.init_from``): where from and its eval before the first step, its τ at
    the selection depth beside the exported checkpoint's, so the gain is read off; nothing otherwise."""
    start, selected = result.get("start"), result.get("selected") or {}
    if not start:
        return {}
    key = f"tau@{selected.get('select_steps', 3)}"
    out: dict[str, Any] = {"warm_start": dg.MetadataValue.json(start)}
    if key in start:
        out[f"start_{key}"] = start[key]
        if selected.get(key) is not None:
            out[f"{key}_gain_over_start"] = round(selected[key] - start[key], 4)
    return out


def materialization_metadata(result: Mapping[str, Any]) -> dict[str, Any]:
    last_eval = result["evals"][-1] if result["evals"] else {}
    return {
        "steps": result["steps"],
        "total_steps": result["total_steps"],
        "resumed_from_step": result["resumed_from_step"] if result["resumed_from_step"] is not None else -1,
        "first_loss": result["first_loss"],
        "last_loss": result["last_loss"],
        **{k: round(v, 4) for k, v in last_eval.items() if k != "step"},
        "wall_s": result["wall_s"],
        "device": result["device"],
        "processes": result["processes"],
        "training_curve": _table(result["curve"]),
        "eval_at_checkpoints": _table(result["evals"]),
        "tau_curve": dg.MetadataValue.json(result["tau_curve"]),
        "export_dir": dg.MetadataValue.path(result["export_dir"]),
        "checkpoint": dg.MetadataValue.path(result["checkpoint"]),
        "drafter": dg.MetadataValue.json(result["drafter"]),
        **selection_metadata(result),
        **start_metadata(result),
    }


def train_rolling(
    context: dg.AssetExecutionContext,
    config: PipelineConfig,
    spec: dict[str, Any],
    ship: list[str],
    fetch: list[str],
    supervisor: Supervisor | None = None,
) -> dict[str, Any]:
    """The rolling loop with the heavy phases as its steps (see the module docstring). ``supervisor``: the
    managed server handed over for the loop; when it is also the extraction server (backend vllm), it serves
    extraction for each window's extract step and is stopped again for its training."""
    layout = ArtifactLayout(config.artifacts_root)
    model = extract_target(config)
    extract_spec = spec_from_config(
        config.hidden_states, config.target, str(layout.training_data), str(layout.hidden_states), model
    )
    extract_ship = [str(layout.training_data)] + ([model] if under_root(model, layout.root) else [])

    server = managed_extraction_server(config)
    extracting = supervisor is not None and server is not None and server.name == supervisor.name

    def extract(shards: list[str]) -> dict[str, Any]:
        if extracting:
            assert supervisor is not None and server is not None
            purpose = extraction_purpose(config.hidden_states, config.source_file, server, supervisor.server.host)
            supervisor.ensure(purpose, f"eagle3_drafter (rolling): extract {len(shards)} shard(s)")
        return run_heavy_phase(
            context,
            config.compute,
            artifacts_root=config.artifacts_root,
            phase="extract",
            spec={**extract_spec, "shards": shards},
            ship=extract_ship,
            **extract_launch(config),
        )

    def train(epoch: int, window: int) -> dict[str, Any]:
        if extracting:
            assert supervisor is not None
            supervisor.release(f"eagle3_drafter (rolling): train epoch {epoch} window {window}")
        rolling_spec = {**spec, "rolling": {"epoch": epoch, "window": window}}
        return run_heavy_phase(
            context,
            config.compute,
            artifacts_root=config.artifacts_root,
            phase="train",
            spec=rolling_spec,
            ship=ship,
            fetch=fetch,
            processes=config.drafter.nproc_per_node,
        )

    def delete(shards: list[str]) -> dict[str, Any]:
        return run_heavy_phase(
            context,
            config.compute,
            artifacts_root=config.artifacts_root,
            phase="extract",
            spec={**extract_spec, "delete_shards": shards},
        )

    windows = read_rolling_layout(layout.hidden_states).windows
    state = drafter_paths(config.artifacts_root)["run_dir"] / STATE_FILE
    return run_rolling(
        state,
        windows,
        epochs=config.drafter.epochs,
        extract=extract,
        train=train,
        delete=delete,
        report=DagsterReporter(context),
    )


def eagle3_drafter(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    resources = StepResources.of_asset(context)
    names = resources.names
    config = fitted(context, resources.config(), "eagle3_drafter")
    require_passing_checks(context.instance, input_checks(names))
    paths = drafter_paths(config.artifacts_root)
    fetch = [
        p.relative_to(config.artifacts_root).as_posix()
        for p in (paths["export_dir"] / "config.json", paths["run_dir"] / TAU_CURVE_FILE)
    ]
    try:
        spec = train_spec(config)
        inputs = [spec["target_weights"], spec["settings"]["init_from"]]
        ship = [str(paths["draft_vocab"])] + [p for p in inputs if p and under_root(p, config.artifacts_root)]
        with hand_over(context, config, names, "eagle3_drafter") as supervisor:
            if config.hidden_states.rolling_window_shards is None:
                result = run_heavy_phase(
                    context,
                    config.compute,
                    artifacts_root=config.artifacts_root,
                    phase="train",
                    spec=spec,
                    ship=ship,
                    fetch=fetch,
                    processes=config.drafter.nproc_per_node,
                )
            else:
                result = train_rolling(context, config, spec, ship, fetch, supervisor)
    except (DrafterSpecError, RemoteError, HostError, RollingError, ExtractionError, StoreError) as exc:
        raise dg.Failure(description=str(exc)) from None
    typed = DrafterResult.from_metadata(result)
    resources.listener.result("eagle3_drafter", None, typed)
    where = {k: result[k] for k in ("compute", "host", "remote_artifacts_root") if k in result}
    rolling = {k: v for k, v in result.items() if k.startswith("rolling_")}
    return dg.MaterializeResult(metadata={**materialization_metadata(typed.as_metadata()), **where, **rolling})


def build_drafter_assets(loaded: PipelineConfig, names: PipelineNames = DEFAULT_NAMES) -> list[dg.AssetsDefinition]:

    eagle3_drafter_asset = dg.asset(
        key_prefix=names.key_prefix,
        group_name=names.name("eagle3"),
        kinds={"pytorch", "safetensors"},
        deps=[names.key("draft_vocab"), names.key("hidden_states")],
        required_resource_keys={names.pipeline, names.phase_listener},
        description="The EAGLE-3 draft model trained on the target's hidden states (training-time test "
        "over drafter.ttt_steps, soft labels over the draft vocabulary), checkpointed and resumable, "
        "exported as a LlamaForCausalLMEagle3 folder that SGLang and vLLM load.",
        **step_policy(loaded, "eagle3_drafter"),
    )(eagle3_drafter)

    return [eagle3_drafter_asset]
