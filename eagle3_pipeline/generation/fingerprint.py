"""The generation fingerprint: what produced a dataset's answers, so that no answer is reused under
other settings.

A fingerprint holds every setting that changes an answer or what is stored of it: the model the
requests name, ``max_tokens``, ``temperature``, ``reasoning`` (keep/strip) and ``regenerate_turns``.
The conversation and tool schemas are not in it: they are the prompt's id (a content hash). The
endpoints (base URLs without credentials) are recorded beside it but not compared, since several
endpoints of the same model may share a dataset; the model each answer came from, as the server
names it, is stored on every answer and must be one per dataset.

``<dataset>.fingerprint.json`` is written (atomically) before the checkpoint's first answer, so an
answer on disk always has its fingerprint on disk. A run compares the configured fingerprint with
it before anything is sent: on a difference it refuses, naming each field with both values, or with
``generation.on_fingerprint_change: new_version`` moves the dataset's files under
``responses/previous/<dataset>.<old digest>-<time>/`` and starts over.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from eagle3_pipeline.config import GenerationConfig, InferenceConfig, TargetConfig
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.records import atomic_path

DIGEST_CHARS = 16


class FingerprintMismatch(RuntimeError):
    """The checkpoint was made under other settings than the configured ones."""


@dataclass(frozen=True)
class GenerationFingerprint:
    model: str
    max_tokens: int
    temperature: float
    reasoning: str
    regenerate_turns: str
    chat_template_kwargs: str = ""  # canonical JSON; left out of the fields when unset (older fingerprints stay valid)

    def fields(self) -> dict[str, Any]:
        fields = asdict(self)
        if not self.chat_template_kwargs:
            del fields["chat_template_kwargs"]
        return fields

    @property
    def digest(self) -> str:
        return digest_of(self.fields())


def digest_of(fields: Mapping[str, Any]) -> str:
    canonical = json.dumps(dict(fields), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:DIGEST_CHARS]


def endpoint_identity(base_url: str) -> str:
    """A base URL without user, password, query or fragment: what may be stored and shown."""
    parts = urlsplit(base_url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def requested_model(target: TargetConfig, inference: InferenceConfig) -> str:
    """The model name(s) the requests carry: ``target.model``, or each endpoint's own ``model``
    (with several inference hosts, every host requests the same ones: the config refuses otherwise)."""
    if inference.kind == "embedded":
        return target.model
    return ", ".join(sorted({e.model or target.model for e in inference.all_endpoints}))


def configured_fingerprint(
    settings: GenerationConfig, target: TargetConfig, inference: InferenceConfig
) -> GenerationFingerprint:
    """The fingerprint the pipeline file's generation settings give the answers."""
    return GenerationFingerprint(
        model=requested_model(target, inference),
        max_tokens=settings.max_tokens,
        temperature=settings.temperature,
        reasoning=settings.reasoning,
        regenerate_turns=settings.regenerate_turns,
        chat_template_kwargs=json.dumps(settings.chat_template_kwargs, sort_keys=True)
        if settings.chat_template_kwargs
        else "",
    )


def configured_endpoints(inference: InferenceConfig) -> list[str]:
    """The endpoints the requests go to, as recorded beside the fingerprint (no credentials)."""
    if inference.kind == "embedded":
        return ["embedded"]
    return [endpoint_identity(e.base_url) for e in inference.all_endpoints]


def read_fingerprint(path: Path) -> dict[str, Any] | None:
    """The stored fingerprint document, or None when there is none."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise FingerprintMismatch(
            f"{path}: not a readable fingerprint ({exc}); move it aside with the checkpoint"
        ) from None
    if not isinstance(document, dict) or not isinstance(document.get("fingerprint"), dict):
        raise FingerprintMismatch(f"{path}: expected an object with a 'fingerprint' object")
    return document


def write_fingerprint(path: Path, fingerprint: GenerationFingerprint, endpoints: Iterable[str]) -> None:
    document = {
        "fingerprint": fingerprint.fields(),
        "digest": fingerprint.digest,
        "endpoints": sorted(set(endpoints)),
        "written_at": time.time(),
    }
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(document, indent=2, sort_keys=True))
        with tmp.open("rb") as handle:
            os.fsync(handle.fileno())


def differences(stored: Mapping[str, Any] | None, configured: GenerationFingerprint) -> list[str]:
    """Each differing field as ``name: checkpoint <old>, configured <new>``."""
    if stored is None:
        return ["fingerprint: the checkpoint has none (written before fingerprints were recorded)"]
    fields = configured.fields()
    return [
        f"{name}: checkpoint {stored.get(name)!r}, configured {value!r}"
        for name, value in fields.items()
        if stored.get(name) != value
    ]


def actual_digest(stored: Mapping[str, Any], served_models: Iterable[str]) -> str:
    """The fingerprint a dataset's answers actually have: the stored settings and the model(s) the
    server named in its answers."""
    return digest_of({**stored, "served_models": sorted(set(served_models))})


def keep_aside(layout: ArtifactLayout, dataset_id: str, version: str) -> Path:
    """Move every file of the dataset's responses under ``responses/previous/``; nothing is deleted."""
    folder = layout.previous_responses(dataset_id, f"{version}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}")
    folder.mkdir(parents=True, exist_ok=False)
    for path in layout.response_files(dataset_id):
        if path.exists():
            os.replace(path, folder / path.name)
    return folder


@dataclass(frozen=True)
class FingerprintDecision:
    """What :func:`settle_fingerprint` did: the fingerprint in force, and where old answers went."""

    fingerprint: GenerationFingerprint
    kept_aside: Path | None


def settle_fingerprint(
    layout: ArtifactLayout,
    configured: GenerationFingerprint,
    endpoints: list[str],
    on_change: Literal["refuse", "new_version"],
    dataset_id: str,
    has_answers: bool,
) -> FingerprintDecision:
    """Make the dataset's stored fingerprint the configured one before anything is sent.

    No answers yet: write the fingerprint (an earlier one's errors file is kept aside with it).
    Answers under the same fingerprint: nothing to do.
    Answers under another one: refuse (:class:`FingerprintMismatch` naming every differing field),
    or with ``on_change`` (``generation.on_fingerprint_change``) ``new_version`` keep the old files aside
    and start over. ``endpoints`` (:func:`configured_endpoints`) are recorded beside the fingerprint."""
    path = layout.fingerprint(dataset_id)
    document = read_fingerprint(path)
    changed = differences(document["fingerprint"] if document else None, configured)
    if not has_answers:
        # Nothing to protect; failures recorded under other settings are kept aside with their fingerprint.
        folder = (
            keep_aside(layout, dataset_id, str(document.get("digest"))) if document is not None and changed else None
        )
        write_fingerprint(path, configured, endpoints)
        return FingerprintDecision(configured, folder)
    if not changed:
        if document is not None and not set(endpoints) <= set(document.get("endpoints", [])):
            write_fingerprint(path, configured, [*document.get("endpoints", []), *endpoints])
        return FingerprintDecision(configured, None)
    if on_change == "refuse":
        raise FingerprintMismatch(
            f"{dataset_id}: the checkpoint {layout.checkpoint(dataset_id)} holds answers made under other generation "
            f"settings, so nothing was sent: {'; '.join(changed)}. Restore the old settings, point artifacts_root "
            "elsewhere, or set generation.on_fingerprint_change: new_version to keep the old answers aside and "
            "regenerate."
        )
    old = str(document.get("digest")) if document else "unversioned"
    folder = keep_aside(layout, dataset_id, old)
    write_fingerprint(path, configured, endpoints)
    return FingerprintDecision(configured, folder)


def partition_is_stale(artifacts_root: Path, configured: GenerationFingerprint, dataset_id: str) -> str | None:
    """Why the dataset's responses need a (re)materialization, or None when they are current.

    Missing table, no fingerprint, a fingerprint other than ``configured`` (:func:`configured_fingerprint`),
    or prompts rewritten after the table. Reads only small files and file times; never contacts a server."""
    layout = ArtifactLayout(artifacts_root)
    table = layout.responses(dataset_id)
    if not table.exists():
        return "missing: no responses table yet"
    try:
        document = read_fingerprint(layout.fingerprint(dataset_id))
    except FingerprintMismatch as exc:
        return f"stale: {exc}"
    changed = differences(document["fingerprint"] if document else None, configured)
    if changed:
        return "stale: generation settings changed: " + "; ".join(changed)
    prompts = layout.prompts(dataset_id)
    if prompts.exists() and prompts.stat().st_mtime > table.stat().st_mtime:
        return "stale: the prompts were rewritten after the responses table"
    return None
