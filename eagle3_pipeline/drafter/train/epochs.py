"""What a training run reads, in which order: each epoch's batches over the train split (or a rolling run's
segments, one per epoch and window), the eval batches each checkpoint evaluates, and each row's
dataset and loss-masked tokens (the τ curve's x axis).

A rolling run (spec ``rolling: {epoch, window}``, driven by :mod:`eagle3_pipeline.drafter.train.rolling`)
schedules the whole run from the store's rolling layout, so its total steps and learning-rate schedule are
those of the whole run, and trains one segment of it (drafter/DESIGN.md, "Rolling windows").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from eagle3_pipeline.drafter.evaluate.phase import read_rows
from eagle3_pipeline.drafter.spec import TrainError, TrainSettings
from eagle3_pipeline.drafter.train.data import Row, epoch_batches, store_rows
from eagle3_pipeline.hidden_states.sharding import RollingLayout
from eagle3_pipeline.hidden_states.store import MASK_KEY, HiddenStateStore


@dataclass(frozen=True)
class TrainingSchedule:
    """``batches[epoch][batch]``: the batches in order (for a rolling run ``epoch`` is the segment);
    ``limit``: the epochs (segments) this run trains up to (all, or the rolling segment's end)."""

    batches: list[list[list[Row]]]
    limit: int
    train_rows: list[Row]
    tokens_of: dict[Row, tuple[str, int]]
    eval_batches: dict[str, list[list[Row]]]
    total_steps: int
    layout: RollingLayout | None

    @property
    def data_tokens(self) -> dict[str, int]:
        """Each dataset's loss-masked tokens over its train rows (one epoch)."""
        out: dict[str, int] = {}
        for row in self.train_rows:
            dataset, tokens = self.tokens_of[row]
            out[dataset] = out.get(dataset, 0) + tokens
        return out

    def advance(self, epoch: int, batch_index: int) -> tuple[int, int]:
        """The data position ``(epoch, batch_index)`` moved past the ends of epochs (a normal form)."""
        while epoch < len(self.batches) and batch_index >= len(self.batches[epoch]):
            epoch, batch_index = epoch + 1, 0
        return epoch, batch_index


def schedule_run(
    store: HiddenStateStore, layout: RollingLayout | None, rolling: Any, settings: TrainSettings
) -> TrainingSchedule:
    """The batch order of a normal run (``layout`` None: every epoch over the store's train rows) or of the
    rolling segment ``rolling`` asks for."""
    tokens_of = row_tokens(store, settings.max_seq_len)
    if layout is None:
        train_rows = store_rows(store, "train")
        batches = [
            epoch_batches(train_rows, settings.seed, e, settings.batch_tokens, settings.max_seq_len)
            for e in range(settings.epochs)
        ]
        limit = settings.epochs
    else:
        batches, layout_tokens = rolling_batches(layout, settings)
        tokens_of.update(layout_tokens)
        train_rows = [row for segment in batches[: len(layout.windows)] for batch in segment for row in batch]
        limit = _segment(rolling, len(layout.windows)) + 1
    if not train_rows:
        raise TrainError(f"{store.root}: no train samples of 3 tokens or more")
    total_steps = sum(len(epoch) for epoch in batches)
    if settings.max_steps is not None:
        total_steps = min(total_steps, settings.max_steps)
    eval_batches = select_eval_batches(store_rows(store, "eval"), tokens_of, settings)
    return TrainingSchedule(batches, limit, train_rows, tokens_of, eval_batches, total_steps, layout)


def row_tokens(store: HiddenStateStore, max_seq_len: int) -> dict[Row, tuple[str, int]]:
    """Each index row's dataset and loss-masked tokens within ``max_seq_len`` (what training reads of
    it): the index's count, or for a longer row its mask read up to ``max_seq_len``."""
    out: dict[Row, tuple[str, int]] = {}
    longer = []
    for r in store.index().to_pylist():
        if r["length"] > max_seq_len:
            longer.append(r)
        else:
            out[Row(r["shard"], r["offset"], r["length"])] = (r["dataset"], int(r["num_masked"]))
    for r, tensors in read_rows(store, longer, (MASK_KEY,)):
        out[Row(r["shard"], r["offset"], r["length"])] = (r["dataset"], int(tensors[MASK_KEY][:max_seq_len].sum()))
    return out


def select_eval_batches(
    rows: Sequence[Row], tokens_of: Mapping[Row, tuple[str, int]], settings: TrainSettings
) -> dict[str, list[list[Row]]]:
    """The batches each checkpoint evaluates, per dataset: at most ``eval_samples`` rows in all, taken
    from the datasets in turn (index order within each), so every eval dataset gets a τ."""
    by_dataset: dict[str, list[Row]] = {}
    for row in rows:
        by_dataset.setdefault(tokens_of[row][0], []).append(row)
    queues = [by_dataset[d] for d in sorted(by_dataset)]
    chosen = [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)][
        : settings.eval_samples
    ]
    per_dataset = {
        d: epoch_batches(
            [r for r in chosen if tokens_of[r][0] == d], settings.seed, -1, settings.batch_tokens, settings.max_seq_len
        )
        for d in sorted(by_dataset)
    }
    return {d: batches for d, batches in per_dataset.items() if batches}


def rolling_batches(
    layout: RollingLayout, settings: TrainSettings
) -> tuple[list[list[list[Row]]], dict[Row, tuple[str, int]]]:
    """The segments of a rolling run, one per (epoch, window), epoch-major, each the window's rows
    (of 3 tokens or more) batched by :func:`epoch_batches` keyed ``epoch/window``; and each train row's
    dataset and loss-masked tokens from the layout (the whole row's, also for a row longer than
    ``max_seq_len``: the τ curve's token counts then include its cut tail)."""
    tokens_of = {Row(r.shard, r.offset, r.length): (r.dataset, r.num_masked) for r in layout.rows}
    rows = [
        [Row(r.shard, r.offset, r.length) for r in layout.window_rows(w) if r.length >= 3]
        for w in range(len(layout.windows))
    ]
    segments = [
        epoch_batches(rows[w], settings.seed, f"{e}/{w}", settings.batch_tokens, settings.max_seq_len)
        for e in range(settings.epochs)
        for w in range(len(rows))
    ]
    return segments, tokens_of


def _segment(rolling: Any, windows: int) -> int:
    """The segment a rolling spec asks for (``{epoch, window}``), checked against the layout."""
    try:
        epoch, window = int(rolling["epoch"]), int(rolling["window"])
    except (TypeError, KeyError, ValueError):
        raise TrainError(f"train spec: rolling: expected {{epoch: int, window: int}}, got {rolling!r}") from None
    if not 0 <= window < windows or epoch < 0:
        raise TrainError(f"train spec: rolling: window {window} of epoch {epoch}; the layout has {windows} windows")
    return epoch * windows + window
