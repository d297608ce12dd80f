"""The `extract` phase: the target's hidden states for every training_data sample, into a store.

``run(spec, report) -> metadata`` (contract C5) is what ``compute: local`` calls in process and
what the worker calls on a GPU host; every path in the spec is a path on the machine it runs on.

In order: open ``training_data`` and compute the shard plan (:mod:`.plan`); if the store is already complete
for these settings (:func:`finished_result`: the same identity, every planned shard complete, its result
recorded under the same check settings), return that result and stop: no state source is opened, so a finished
phase needs no server, and the checks are the ones recorded when the store was completed. Else open the state source
(:class:`StateSource`: ``backend: transformers``, the target in process, :mod:`.capture`; ``backend:
sglang``, SGLang's model runner with tensor parallelism, :mod:`.sglang_capture`; ``backend: vllm``, a
vLLM server started with ``extract_hidden_states``, its layer ids proven first, :mod:`.vllm_capture`) and check the
store's identity (a store made under other settings is an error naming the fields, or is replaced
with ``overwrite``); estimate the bytes still to write and refuse when the disk has less free than
that times ``disk_margin``; extract every shard that is not complete (length-sorted batches of at
most ``batch_tokens`` padded tokens; one shard in memory at a time); write the index and the
manifest; then re-compute ``spot_check_samples`` samples one by one (the source's
``reference_states``) and compare (relative L2 error per tensor ≤ ``spot_check_tolerance``, per backend when
null: :data:`SPOT_CHECK_TOLERANCE`); record the result (``result.json``).

Every backend goes through this one loop; only "the states of a batch of sequences" differs. Under
tensor parallelism every rank runs the loop (each forward needs all of them) and the source's
writer (rank 0) alone touches the store: it decides which shards to do, shares that decision and
the spot-check samples with the other ranks, and writes.

Rolling mode (``rolling_window_shards``, :mod:`eagle3_pipeline.drafter.rolling`): the phase extracts
only the eval shards (the store's index and manifest cover those; the spot check samples them),
records the train rows' layout (:func:`.plan.rolling_layout`) and checks the disk for the eval
shards plus the largest window. The rolling loop then calls the phase with ``shards`` (extract these
planned train shards into the existing store, with the same per-shard resume; index and manifest
stay as they are) and with ``delete_shards`` (remove a trained window's files; no target loaded).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from pydantic import ValidationError

from eagle3_pipeline.compute import Reporter
from eagle3_pipeline.config import HiddenStatesConfig, PipelineConfig, TargetConfig
from eagle3_pipeline.hidden_states.capture import SampleError, check_layer_ids, load_target, target_identity
from eagle3_pipeline.hidden_states.inputs import TrainingData, TrainingDataError, iter_rows
from eagle3_pipeline.hidden_states.plan import (
    PLAN_FILE,
    ROLLING_LAYOUT_FILE,
    PlannedShard,
    plan_shards,
    rolling_layout,
    write_plan,
    write_rolling_layout,
)
from eagle3_pipeline.hidden_states.store import (
    AUX_KEY,
    BF16,
    HIDDEN_KEY,
    IDS_KEY,
    HiddenStateStore,
    ShardFile,
    ShardWriter,
    StoreError,
    StoreManifest,
    TargetIdentity,
    as_stored,
    bytes_per_token,
    default_aux_layer_ids,
    identity_mismatch,
)
from eagle3_pipeline.hidden_states.validation import (
    Comparison,
    ServingReferenceError,
    ValidationFailed,
    check_states,
    compare,
    load_lm_head,
    load_reference,
    teacher_argmax,
    tokenization_problems,
    verdict,
)
from eagle3_pipeline.target import TargetError

ROW_COLUMNS = ["id", "dataset", "input_ids", "loss_mask"]
# The metadata of the run that completed the store, with the settings its checks ran under
# (:func:`finished_result`); removed before a run changes the store.
RESULT_FILE = "result.json"
GB = 1e9
# The spot check's tolerance when hidden_states.spot_check_tolerance is null, per backend (its description says why).
SPOT_CHECK_TOLERANCE = {"transformers": 0.01, "sglang": 0.01, "vllm": 0.1}
T = TypeVar("T")


class StateSource(Protocol):
    """What computes the target's states for the loop: :class:`.capture.Target` (transformers),
    :class:`.sglang_capture.SGLangTarget` (SGLang, one rank of a tensor-parallel launch) or
    :class:`.vllm_capture.VllmTarget` (a vLLM server). A refusal of one sequence is a
    :class:`SampleError`."""

    identity: TargetIdentity
    spot_check_method: str

    @property
    def writer(self) -> bool:
        """This process writes the store (rank 0; the only process for transformers)."""
        ...

    def describe(self) -> str: ...

    def capture(self, aux_layer_ids: Sequence[int]) -> dict[str, Any]:
        """How the states are captured (the manifest's ``capture`` record)."""
        ...

    def share(self, value: T) -> T:
        """The writer's ``value``, on every rank."""
        ...

    def batch_states(self, aux_layer_ids: Sequence[int], sequences: Sequence[Sequence[int]]) -> list[tuple[Any, Any]]:
        """``(aux [T, 3H], hidden [T, H])`` per sequence, in order."""
        ...

    def reference_states(self, aux_layer_ids: Sequence[int], sequence: Sequence[int]) -> tuple[Any, Any]:
        """One sequence alone, for the spot check."""
        ...


class ExtractionError(RuntimeError):
    """The phase cannot (or must not) go on; the message says why and what to change."""


class ExtractSpec(HiddenStatesConfig):
    """The spec of the `extract` phase (JSON): the `hidden_states:` settings plus where things are.
    Paths are on the machine where the phase runs."""

    training_data: str
    output: str
    # Required here where the settings allow None (the resolved model folder); pydantic lets a subclass
    # narrow a field, pyright wants the default kept.
    model: str  # pyright: ignore[reportGeneralTypeIssues]
    target_name: str
    trust_remote_code: bool = False
    shards: list[str] | None = None  # rolling: extract only these planned shards (a window) into the existing store
    delete_shards: list[str] | None = None  # rolling: delete these shards' files (a trained window), nothing else
    # The serving target's recorded answers (validation.record_reference); None: not validated.
    serving_reference: str | None = None


def target_weights(config: PipelineConfig) -> str:
    """What transformers loads as the target: `hidden_states.model`, else the embedded model's
    folder (embedded profile) or `target.tokenizer` (endpoints: the served model's repository).
    On a GPU host (`compute.kind` ssh or command) it is read there: the embedded model's folder is
    a path on this machine, so `hidden_states.model` must then name the target's folder there."""
    if config.hidden_states.model:
        return config.hidden_states.model
    if config.inference.kind == "embedded":
        if config.compute.kind != "local":
            raise ExtractionError(
                f"hidden_states.model: required with compute.kind {config.compute.kind!r}: the target model's folder "
                "(or Hugging Face id) on the GPU host; the embedded model's folder is a path on this machine"
            )
        from eagle3_pipeline.serving import local_model_dir

        return str(local_model_dir())
    return str(config.target.tokenizer)


def spec_from_config(
    hidden_states: HiddenStatesConfig,
    target: TargetConfig,
    training_data: str,
    output: str,
    model: str,
    serving_reference: str | None = None,
) -> dict[str, Any]:
    """The phase's spec from the pipeline file's `hidden_states` and `target` sections, with paths as
    seen where the phase will run."""
    settings = hidden_states.model_dump(exclude={"model"})
    return {
        **settings,
        "training_data": training_data,
        "output": output,
        "model": model,
        "target_name": target.model,
        "trust_remote_code": target.trust_remote_code,
        "serving_reference": serving_reference,
    }


def parse_spec(spec: dict[str, Any]) -> ExtractSpec:
    try:
        return ExtractSpec.model_validate(spec)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ExtractionError(f"extract spec: {problems}") from None


def free_bytes(folder: Path) -> int:
    """Free bytes on the filesystem that holds ``folder`` (or its nearest existing parent)."""
    probe = folder.resolve()
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def check_disk(folder: Path, tokens: int, per_token: int, margin: float) -> dict[str, int]:
    estimate = tokens * per_token
    free = free_bytes(folder)
    if free < estimate * margin:
        raise ExtractionError(
            f"not enough free disk for the hidden states under {folder}: {free} bytes ({free / GB:.2f} GB) free, "
            f"the phase will write about {estimate} bytes "
            f"({estimate / GB:.2f} GB: {tokens} tokens × {per_token} bytes/token) "
            f"and needs that × disk_margin {margin} = {estimate * margin / GB:.2f} GB"
        )
    return {"disk_free_bytes": free, "disk_estimate_bytes": estimate}


def _store_state(store: HiddenStateStore, wanted: StoreManifest, overwrite: bool) -> Literal["new", "same", "replace"]:
    """``same``: the folder holds a store of this identity (its complete shards are kept); ``new``:
    no store yet; ``replace``: another store, to be cleared (only with ``overwrite``, else refused)."""
    if store.manifest_path.is_file():
        problems = identity_mismatch(store.manifest(), wanted)
    elif store.root.is_dir() and any(store.root.glob("shard-*")):
        problems = ["it holds shards but no manifest.json"]
    else:
        return "new"
    if problems and not overwrite:
        raise ExtractionError(
            f"{store.root}: the hidden-state store was made under other settings ({'; '.join(problems)}); "
            "set hidden_states.overwrite: true to replace it"
        )
    return "replace" if problems else "same"


def _shard_reusable(store: HiddenStateStore, shard: PlannedShard) -> bool:
    import pyarrow.parquet as pq

    if not store.shard_complete(shard.name):
        return False
    ids = (
        pq.read_table(store.root / f"{shard.name}.index.parquet", columns=["sample_id"]).column("sample_id").to_pylist()
    )
    return tuple(ids) == shard.sample_ids


def _remove_torn(store: HiddenStateStore) -> None:
    for path in store.root.glob(".shard-*.tmp"):
        path.unlink()


def _remove_leftovers(store: HiddenStateStore, planned: Sequence[PlannedShard]) -> None:
    """Delete torn temporaries, shards outside the plan and the index of an earlier plan."""
    names = {s.name for s in planned}
    _remove_torn(store)
    for path in store.root.glob("shard-*"):
        if path.name.split(".")[0] not in names:
            path.unlink()
    store.index_path.unlink(missing_ok=True)


class _Rows:
    """Reads planned rows in plan order, keeping one training_data shard's reader open."""

    def __init__(self, data: TrainingData) -> None:
        self.data = data
        self.source: str | None = None
        self.position = 0
        self.rows: Any = iter(())

    def take(self, shard: PlannedShard) -> list[dict[str, Any]]:
        if shard.source != self.source or shard.start != self.position:
            self.rows = iter_rows(self.data.folder / shard.source, ROW_COLUMNS, shard.start)
            self.source, self.position = shard.source, shard.start
        taken = [next(self.rows) for _ in shard.sample_ids]
        self.position += len(taken)
        found = tuple(r["id"] for r in taken)
        if found != shard.sample_ids:
            raise ExtractionError(
                f"{self.data.folder / shard.source}: rows changed while extracting {shard.name}; rerun"
            )
        return taken


def batches(lengths: Sequence[int], batch_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Indices grouped longest first, each group's padded size (count × longest) ≤ batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for index in order:
        if (
            groups
            and len(groups[-1]) < max_batch_size
            and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= batch_tokens
        ):
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def extract_shard(
    store: HiddenStateStore,
    source: StateSource,
    spec: ExtractSpec,
    aux_ids: Sequence[int],
    shard: PlannedShard,
    rows: list[dict[str, Any]],
) -> int:
    """Extract one planned shard and write it (the writer only); returns its tensor file's size (0 elsewhere)."""
    import torch

    states: dict[int, tuple[Any, Any]] = {}
    for group in batches([len(r["input_ids"]) for r in rows], spec.batch_tokens, spec.max_batch_size):
        try:
            found = source.batch_states(aux_ids, [rows[i]["input_ids"] for i in group])
        except SampleError as exc:
            row = rows[group[exc.index]]
            raise ExtractionError(f"{shard.name} ({shard.split}), sample {row['id']!r}: {exc.message}") from None
        for index, (aux, hidden) in zip(group, found, strict=True):
            states[index] = (aux.to("cpu", torch.bfloat16), hidden.to("cpu", torch.bfloat16))
    if not source.writer:
        return 0
    writer = ShardWriter(store.root, int(shard.name.split("-")[1]), spec.storage_dtype)
    for index, row in enumerate(rows):
        aux, hidden = states.pop(index)
        ids = torch.tensor(row["input_ids"], dtype=torch.int32)
        mask = torch.tensor(row["loss_mask"], dtype=torch.uint8)
        try:
            writer.add(row["id"], row["dataset"], shard.split, ids, mask, aux, hidden)
        except StoreError as exc:
            raise ExtractionError(
                f"{shard.name} ({shard.split}, {shard.source} row {shard.start + index}): {exc}; "
                "the shard is not written"
            ) from None
    return writer.close()


def _relative_error(found: Any, expected: Any) -> float:
    diff = (found.float() - expected.float()).norm()
    scale = expected.float().norm()
    return float(diff / scale) if float(scale) > 0 else float(diff)


def spot_check_ids(index_ids: Sequence[str], count: int) -> list[str]:
    """A fixed sample of the store's ids: the ``count`` with the smallest SHA-256."""
    return sorted(index_ids, key=lambda i: hashlib.sha256(i.encode()).hexdigest())[:count]


def _stored_slice(store: HiddenStateStore, row: dict[str, Any], key: str) -> Any:
    """One sample's stored tensor (states dequantized to bf16 from an fp8 store)."""
    return ShardFile(store.root / f"{row['shard']}.safetensors").read(key, row["offset"], row["offset"] + row["length"])


def spot_check(
    store: HiddenStateStore,
    source: StateSource,
    aux_ids: Sequence[int],
    count: int,
    tolerance: float,
    dtype: str = BF16,
) -> dict[str, Any]:
    """Re-compute ``count`` stored samples alone through the source's ``reference_states`` (every
    rank: the writer shares which); the writer compares them with the store in bf16, the fresh
    states rounded as the store's ``dtype`` rounds them (fp8's own rounding, up to a few % per
    sample, is the storage's cost, measured by benchmarks/store_dtype_tau.py; what the check looks
    for is states that belong to another token, layer or sample)."""
    chosen: list[dict[str, Any]] = []
    if source.writer:
        rows = store.index().to_pylist()
        picked = set(spot_check_ids([r["sample_id"] for r in rows], count))
        chosen = [
            {**row, "input_ids": _stored_slice(store, row, IDS_KEY).tolist()}
            for row in rows
            if row["sample_id"] in picked
        ]
    chosen = source.share(chosen)
    worst, worst_id = 0.0, ""
    for row in chosen:
        try:
            aux, hidden = source.reference_states(aux_ids, row["input_ids"])
        except SampleError as exc:
            raise ExtractionError(f"spot check, sample {row['sample_id']!r}: {exc.message}") from None
        if not source.writer:
            continue
        for key, fresh, layers in ((AUX_KEY, aux, len(aux_ids)), (HIDDEN_KEY, hidden, 1)):
            error = _relative_error(_stored_slice(store, row, key), as_stored(fresh.to("cpu"), layers, dtype))
            if error > worst:
                worst, worst_id = error, row["sample_id"]
    return {
        "spot_check_samples": len(chosen),
        "spot_check_method": source.spot_check_method,
        "spot_check_max_rel_error": worst,
        "spot_check_worst_sample": worst_id,
        "spot_check_tolerance": tolerance,
        "spot_check_passed": worst <= tolerance,
    }


def _validation_plan(settings: ExtractSpec, data: TrainingData) -> dict[str, Any]:
    """The writer's part: the recorded reference's samples, or why there is nothing to validate against."""
    if not settings.validation.samples:
        return {"skip": "hidden_states.validation.samples is 0"}
    if settings.serving_reference is None:
        return {"skip": "no serving reference was given to the phase"}
    try:
        reference, reason = load_reference(Path(settings.serving_reference), data.version())
    except ServingReferenceError as exc:
        raise ExtractionError(str(exc)) from None
    if reference is None:
        return {"skip": reason}
    problems = tokenization_problems(reference)
    if problems:
        raise ExtractionError(
            "validation against the serving target: training_data was tokenized by a tokenizer other than "
            "the served model's "
            f"({reference.tokenizer} vs {reference.server}): {'; '.join(problems[:3])}"
        )
    return {"reference": reference}


def _load_lm_head(model: str) -> Any:
    try:
        return load_lm_head(model)
    except TargetError as exc:
        raise ExtractionError(
            f"validation against the serving target needs the target's lm_head from its checkpoint folder: {exc}"
        ) from None


def validate_first(
    source: StateSource, settings: ExtractSpec, data: TrainingData, aux_ids: Sequence[int], report: Reporter
) -> dict[str, Any]:
    """Before any shard: the reference samples through the source (every rank), their teacher's
    argmax under lm_head against the serving target's greedy tokens (the writer, which shares its
    verdict). Raises :class:`ExtractionError` below ``validation.min_agreement``; without a
    reference, says so."""
    plan = _decided(source, lambda: _validation_plan(settings, data))
    if "skip" in plan:
        report.log(f"extract: NOT validated against the serving target: {plan['skip']}")
        return {"serving_validation": "not validated", "serving_validation_detail": plan["skip"]}
    reference = plan["reference"]
    identity = source.identity
    loaded: dict[str, Any] = {}

    def load() -> bool:
        loaded["lm_head"] = _load_lm_head(settings.model)
        return True

    _decided(source, load)
    result, failure = Comparison(), ""
    for sample in reference.samples:
        try:
            aux, hidden = source.reference_states(aux_ids, sample.input_ids)
        except SampleError as exc:
            raise ExtractionError(f"validation, sample {sample.sample_id!r}: {exc.message}") from None
        if not source.writer or failure:
            continue
        try:
            check_states(sample, aux, hidden, len(aux_ids) * identity.hidden_size, identity.hidden_size)
        except ValidationFailed as exc:
            failure = f"validation against the serving target: {exc}"
            continue
        compare(sample, teacher_argmax(hidden, loaded["lm_head"]), settings.validation.near_tie_logprob_margin, result)

    def decide() -> dict[str, Any]:
        if failure:
            raise ExtractionError(failure)
        try:
            return verdict(reference, result, settings.validation)
        except ValidationFailed as exc:
            raise ExtractionError(f"validation against the serving target, before extraction: {exc}") from None

    meta = _decided(source, decide)
    if meta["serving_validation"] != "passed":
        report.log(f"extract: NOT validated against the serving target: {meta['serving_validation_detail']}")
        return meta
    near = (
        f"{meta['serving_near_ties']} near-ties apart"
        if meta["serving_near_ties_known"]
        else "near-ties unknown: the server gives no logprobs"
    )
    report.log(
        f"extract: validated against {meta['serving_reference']}: agreement {meta['serving_agreement']:.2%} over "
        f"{meta['serving_positions']} positions of {meta['serving_samples']} samples ({near})"
    )
    return {**meta, "serving_validation_detail": f"{result.agreed}/{result.compared} positions agree"}


@contextmanager
def open_source(settings: ExtractSpec) -> Iterator[StateSource]:
    """The state source ``hidden_states.backend`` names, on this process (one rank under torchrun)."""
    if settings.backend == "sglang":
        from eagle3_pipeline.hidden_states.sglang_capture import open_sglang_target

        with open_sglang_target(
            settings.model,
            settings.target_name,
            tp_size=settings.tp_size,
            dtype=settings.dtype,
            mem_fraction_static=settings.mem_fraction_static,
            max_batch_size=settings.max_batch_size,
            trust_remote_code=settings.trust_remote_code,
        ) as sglang_target:
            yield sglang_target
    elif settings.backend == "vllm":
        from eagle3_pipeline.hidden_states.vllm_capture import open_vllm_target

        assert (
            settings.vllm_base_url is not None and settings.vllm_output_dir is not None
        )  # HiddenStatesConfig requires both
        with open_vllm_target(
            settings.model,
            settings.target_name,
            settings.vllm_base_url,
            settings.vllm_output_dir,
            settings.max_batch_size,
        ) as vllm_target:
            vllm_target.check_layers(aux_layer_ids(settings, vllm_target.identity))
            yield vllm_target
    else:
        yield load_target(
            settings.model, settings.target_name, settings.device, settings.dtype, settings.trust_remote_code
        )


def aux_layer_ids(settings: HiddenStatesConfig, identity: TargetIdentity) -> list[int]:
    """The store's aux layer ids (output of layer): ``aux_layer_ids``, else the EAGLE-3 default for the target."""
    return list(settings.aux_layer_ids or default_aux_layer_ids(identity.num_layers))


def _checked_with(settings: ExtractSpec) -> dict[str, Any]:
    """The settings a recorded result holds only under: its checks' and the layout's (rolling mode)."""
    return settings.model_dump(
        include={"spot_check_samples", "spot_check_tolerance", "validation", "rolling_window_shards"}
    )


def finished_result(settings: ExtractSpec, data: TrainingData, planned: list[PlannedShard]) -> dict[str, Any] | None:
    """The recorded metadata of the run that completed the store, when this run has nothing left to do:
    the store's identity is the one these settings and rows give (the target's from its config.json
    alone), it holds exactly the planned shards, each complete with the planned samples, and its
    result was recorded under the same check settings. None otherwise, and when it cannot be told here
    (the target's config or the shards not on this machine). No state source is opened for it."""
    store = HiddenStateStore(Path(settings.output))
    result = store.root / RESULT_FILE
    if settings.shards is not None or not (result.is_file() and store.manifest_path.is_file()):
        return None
    try:
        identity = target_identity(settings.model, settings.target_name)
        found = store.manifest()
        recorded = json.loads(result.read_text())
    except (TargetError, StoreError, OSError, ValueError):
        return None
    wanted = StoreManifest(identity, aux_layer_ids(settings, identity), data.version(), dtype=settings.storage_dtype)
    selected = _selected(settings, planned)
    same = (
        not identity_mismatch(found, wanted)
        and found.shards == [s.name for s in selected]
        and recorded.get("checked_with") == _checked_with(settings)
        and store.index_path.is_file()
        and (settings.rolling_window_shards is None or (store.root / ROLLING_LAYOUT_FILE).is_file())
    )
    return recorded["metadata"] if same and all(_shard_reusable(store, s) for s in selected) else None


def nothing_to_do(spec: dict[str, Any]) -> bool:
    """Whether the phase with ``spec`` (paths as seen here) would find its store complete
    (:func:`finished_result`): so that a caller asks no server for it. False where it cannot be told here
    (on a GPU host's store only its index and manifest are on this machine)."""
    settings = parse_spec(spec)
    try:
        data = TrainingData.open(Path(settings.training_data))
    except TrainingDataError:
        return False
    return finished_result(settings, data, plan_shards(data, settings.shard_tokens)) is not None


def _record_result(store: HiddenStateStore, settings: ExtractSpec, meta: dict[str, Any]) -> None:
    completed = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    tmp = store.root / f".{RESULT_FILE}.tmp"
    tmp.write_text(
        json.dumps({"checked_with": _checked_with(settings), "metadata": {**meta, "completed_at": completed}})
    )
    tmp.replace(store.root / RESULT_FILE)


def _decided(source: StateSource, decide: Callable[[], T]) -> T:
    """``decide()`` on the writer, its result (or its error) on every rank."""
    outcome: Any = None
    if source.writer:
        try:
            outcome = decide()
        except (ExtractionError, StoreError) as exc:
            outcome = exc
    outcome = source.share(outcome)
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def on_disk(store: HiddenStateStore) -> dict[str, int]:
    """The shard tensor files in the store now (rolling mode reports its disk peak from these)."""
    files = list(store.root.glob("shard-*.safetensors"))
    return {"shard_files_on_disk": len(files), "shard_bytes_on_disk": sum(p.stat().st_size for p in files)}


def delete_shards(store: HiddenStateStore, names: Sequence[str], report: Reporter) -> dict[str, Any]:
    """Remove a trained rolling window's shard files (index first: a kill midway leaves an incomplete
    shard, which is never reused). A shard the store's index holds (an eval shard) is refused."""
    kept = set(store.manifest().shards) if store.manifest_path.is_file() else set()
    refused = sorted(set(names) & kept)
    if refused:
        raise ExtractionError(
            f"{store.root}: refusing to delete {refused}: the store's index holds them "
            "(they are not a rolling window's)"
        )
    for name in names:
        for suffix in (".index.parquet", ".safetensors"):
            (store.root / f"{name}{suffix}").unlink(missing_ok=True)
    report.log(
        f"extract: deleted {len(names)} trained shard(s) {names[0] if names else ''}…{names[-1] if names else ''}"
    )
    return {"shards_deleted": len(names), **on_disk(store)}


def _prepare_store(
    store: HiddenStateStore,
    wanted: StoreManifest,
    planned: list[PlannedShard],
    selected: list[PlannedShard],
    data: TrainingData,
    settings: ExtractSpec,
    per_token: int,
) -> tuple[list[str], list[str], dict[str, int]]:
    """The writer's part before extracting ``selected``: identity, reusable shards, disk, manifest,
    leftovers, plan (rolling: the layout, and the disk for one window too; a window: disk only)."""
    state = _store_state(store, wanted, settings.overwrite)
    window = settings.shards is not None
    if not window:
        (store.root / RESULT_FILE).unlink(missing_ok=True)
    if window and state != "same":
        raise ExtractionError(
            f"{store.root}: no hidden-state store of these settings to extract a rolling window into; "
            "materialize hidden_states first"
        )
    reused = [s for s in selected if state == "same" and _shard_reusable(store, s)]
    todo = [s for s in selected if s not in reused]
    tokens = sum(s.tokens for s in todo)
    layout = None
    if settings.rolling_window_shards is not None and not window:
        layout = rolling_layout(data, planned, settings.rolling_window_shards)
        by_name = {s.name: s.tokens for s in planned}
        tokens += max((sum(by_name[n] for n in w) for w in layout.windows), default=0)
    disk = check_disk(store.root, tokens, per_token, settings.disk_margin)
    if window:
        _remove_torn(store)
    else:
        store.write_manifest(wanted)
        _remove_leftovers(store, planned if state == "same" else [])
        write_plan(store.root, settings.shard_tokens, planned, None if layout is None else layout.eval_shards)
    if layout is not None:
        write_rolling_layout(store.root, layout)
    elif not window:
        (store.root / ROLLING_LAYOUT_FILE).unlink(missing_ok=True)  # a whole store: no layout of an earlier rolling one
    return [s.name for s in reused], [s.name for s in todo], disk


def run(spec: dict[str, Any], report: Reporter, source: StateSource | None = None) -> dict[str, Any]:
    """The phase (C5): extract every sample of ``spec['training_data']`` into ``spec['output']``.
    ``source``: a state source already open in this process, used instead of opening the one the spec
    names (one loaded target for several rolling windows)."""
    settings = parse_spec(spec)
    if settings.delete_shards is not None:
        return delete_shards(HiddenStateStore(Path(settings.output)), settings.delete_shards, report)
    data = TrainingData.open(Path(settings.training_data))
    planned = plan_shards(data, settings.shard_tokens)
    if not planned:
        raise ExtractionError(f"{data.folder}: training_data has no sample")
    unknown = sorted(set(settings.shards or []) - {s.name for s in planned})
    if unknown:
        raise ExtractionError(
            f"extract spec: shards {unknown} are not in the plan of {data.folder} "
            f"at shard_tokens {settings.shard_tokens}"
        )
    if source is not None:
        return _extract(settings, data, planned, source, report)
    done = finished_result(settings, data, planned)
    if done is not None:
        report.log(
            f"extract: {settings.output} is complete for these settings ({done['shards']} shards, {done['samples']} "
            f"samples): nothing to extract, no state source opened; its checks as recorded when it was completed "
            f"({done['completed_at']})"
        )
        return {
            **done,
            "shards_written": 0,
            "shards_reused": done["shards"],
            "tokens_extracted_now": 0,
            "extract_seconds": 0.0,
            "tokens_per_s": 0.0,
            "disk_free_bytes": free_bytes(Path(settings.output)),
            "disk_estimate_bytes": 0,
        }
    with open_source(settings) as opened:
        return _extract(settings, data, planned, opened, report)


def _selected(settings: ExtractSpec, planned: list[PlannedShard]) -> list[PlannedShard]:
    """The shards this run extracts: a window's, rolling mode's eval shards, or all."""
    if settings.shards is not None:
        return [s for s in planned if s.name in settings.shards]
    if settings.rolling_window_shards is not None:
        return [s for s in planned if s.split == "eval"]
    return planned


def _extract(
    settings: ExtractSpec, data: TrainingData, planned: list[PlannedShard], source: StateSource, report: Reporter
) -> dict[str, Any]:
    store = HiddenStateStore(Path(settings.output))
    selected = _selected(settings, planned)
    identity = source.identity
    aux_ids = aux_layer_ids(settings, identity)
    check_layer_ids(aux_ids, identity.num_layers)
    wanted = StoreManifest(
        target=identity,
        aux_layer_ids=list(aux_ids),
        training_data_version=data.version(),
        dtype=settings.storage_dtype,
        capture=source.capture(aux_ids),
    )
    per_token = bytes_per_token(identity.hidden_size, len(aux_ids), settings.storage_dtype)
    # A rolling window extends a store whose hidden_states run already validated the source.
    validated = validate_first(source, settings, data, aux_ids, report) if settings.shards is None else {}
    reused_names, todo_names, disk = _decided(
        source, lambda: _prepare_store(store, wanted, planned, selected, data, settings, per_token)
    )
    reused = [s for s in planned if s.name in reused_names]
    todo = [s for s in planned if s.name in todo_names]
    report.log(
        f"extract: {len(planned)} shards planned, {len(selected)} to hold, {len(reused)} complete, {len(todo)} to do "
        f"({sum(s.tokens for s in todo)} tokens, ~{disk['disk_estimate_bytes'] / GB:.2f} GB in "
        f"{settings.storage_dtype}, {per_token} bytes/token); "
        f"target {identity.name} ({identity.num_layers} layers, H={identity.hidden_size}) with {source.describe()}, "
        f"aux layers {aux_ids} (output-of-layer ids)"
    )
    if reused:
        report.log(f"extract: reusing {', '.join(s.name for s in reused)}")
    rows = _Rows(data)
    started, tokens_now = time.monotonic(), 0
    for number, shard in enumerate(todo, start=1):
        size = extract_shard(store, source, settings, aux_ids, shard, rows.take(shard))
        tokens_now += shard.tokens
        elapsed = time.monotonic() - started
        report.log(
            f"extract: wrote {shard.name} ({shard.split}, {len(shard.sample_ids)} samples, "
            f"{shard.tokens} tokens, {size} bytes)"
        )
        report.progress(
            {
                "shards_done": len(reused) + number,
                "shards_planned": len(selected),
                "tokens_done": tokens_now,
                "tokens_per_s": round(tokens_now / elapsed, 1) if elapsed else 0.0,
                "bytes_per_token": round(size / shard.tokens, 1),
            }
        )
    extract_seconds = time.monotonic() - started
    if settings.shards is not None:
        return {
            "shards_written": len(todo),
            "shards_reused": len(reused),
            "tokens_extracted_now": tokens_now,
            "extract_seconds": round(extract_seconds, 2),
            "tokens_per_s": round(tokens_now / extract_seconds, 1) if tokens_now and extract_seconds else 0.0,
            **(on_disk(store) if source.writer else {}),
        }
    names = [s.name for s in selected]
    if source.writer:
        index = store.write_index(names)
        wanted.shards, wanted.samples, wanted.bytes = (
            names,
            index.num_rows,
            sum((store.root / f"{n}.safetensors").stat().st_size for n in names),
        )
        wanted.tokens = int(sum(index.column("length").to_pylist()))
        store.write_manifest(wanted)
    tolerance = settings.spot_check_tolerance or SPOT_CHECK_TOLERANCE[settings.backend]
    checked = spot_check(store, source, aux_ids, settings.spot_check_samples, tolerance, settings.storage_dtype)
    if not source.writer:
        return {"shards_written": len(todo)}
    report.log(
        f"extract: spot check of {checked['spot_check_samples']} samples ({source.spot_check_method}): "
        "max relative error "
        f"{checked['spot_check_max_rel_error']:.2e} (tolerance {tolerance})"
    )
    splits = index.column("split").to_pylist()
    rolling: dict[str, Any] = {}
    if settings.rolling_window_shards is not None:
        train = [s for s in planned if s.split == "train"]
        rolling = {
            "rolling_window_shards": settings.rolling_window_shards,
            "rolling_train_shards": len(train),
            "rolling_train_tokens": sum(s.tokens for s in train),
            "rolling_layout": str(store.root / ROLLING_LAYOUT_FILE),
        }
    meta = {
        "store": str(store.root),
        "samples": index.num_rows,
        "train_samples": splits.count("train"),
        "eval_samples": splits.count("eval"),
        "tokens": wanted.tokens,
        "bytes": wanted.bytes,
        "bytes_per_token": round(wanted.bytes_per_token, 2),
        "bytes_per_token_formula": per_token,
        "bytes_per_token_ratio": round(wanted.bytes_per_token / per_token, 4),
        "storage_dtype": settings.storage_dtype,
        "disk_training_data_bytes": sum(s.tokens for s in planned) * per_token,
        "shards": len(selected),
        "shards_written": len(todo),
        "shards_reused": len(reused),
        "tokens_extracted_now": tokens_now,
        "extract_seconds": round(extract_seconds, 2),
        "tokens_per_s": round(tokens_now / extract_seconds, 1) if tokens_now and extract_seconds else 0.0,
        "aux_layer_ids": list(aux_ids),
        "layer_convention": wanted.layer_convention,
        "teacher": wanted.teacher,
        "capture": wanted.capture,
        "target": identity.name,
        "target_config_sha256": identity.config_sha256,
        "target_layers": identity.num_layers,
        "target_hidden_size": identity.hidden_size,
        "training_data_version": wanted.training_data_version,
        "backend": settings.backend,
        "device": wanted.capture.get("device", ""),
        "dtype": wanted.capture.get("dtype", ""),
        "plan": str(store.root / PLAN_FILE),
        **disk,
        **checked,
        **rolling,
        **validated,
    }
    _record_result(store, settings, meta)
    return meta
