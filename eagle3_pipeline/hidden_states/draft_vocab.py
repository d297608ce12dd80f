"""The draft vocabulary: the target ids the drafter predicts, chosen by masked-token frequency.

EAGLE-3 drafters predict over a sub-vocabulary of the target's (SpecForge's ``generate_vocab_mapping_file``): the
``size`` ids that occur most often among the tokens the drafter is trained on (the loss-masked
tokens of the train split), sorted ascending, as ``d2t`` (draft id → offset to the target id) and
``t2d`` (a bool mask over the target vocabulary). Ties are broken by the lower id; when fewer
distinct ids occur than ``size``, the lowest unused ids (count 0) fill the rest, as SpecForge does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from eagle3_pipeline.hidden_states.store import save_draft_vocab
from eagle3_pipeline.training_data.reader import READ_BATCH_ROWS, TrainingData, TrainingDataError

MIN_DEFAULT_SIZE = 1024


def default_draft_vocab_size(target_vocab_size: int) -> int:
    """A quarter of the target vocabulary, at least 1024 ids (all of a vocabulary smaller than that).

    A quarter is what the published EAGLE-3 drafters use: 32 000 draft ids for Llama 3's 128 256.
    The draft ``lm_head`` then costs a quarter of the target's, while the frequent quarter of a
    BPE vocabulary covers nearly every generated token (the coverage is measured and checked).
    """
    return min(target_vocab_size, max(MIN_DEFAULT_SIZE, target_vocab_size // 4))


def masked_token_counts(files: list[Path], vocab_size: int) -> np.ndarray:
    """How often each target id occurs among the loss-masked tokens of these shards."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for path in files:
        try:
            batches = pq.ParquetFile(path).iter_batches(batch_size=READ_BATCH_ROWS, columns=["input_ids", "loss_mask"])
            for batch in batches:
                ids = batch.column("input_ids").flatten().to_numpy(zero_copy_only=False)
                mask = batch.column("loss_mask").flatten().to_numpy(zero_copy_only=False)
                if ids.shape != mask.shape:
                    raise TrainingDataError(f"{path}: input_ids and loss_mask have different lengths")
                masked = ids[mask != 0]
                if masked.size and (masked.min() < 0 or masked.max() >= vocab_size):
                    raise TrainingDataError(
                        f"{path}: token id {int(masked.max())} is outside the target vocabulary of {vocab_size} ids"
                    )
                counts += np.bincount(masked, minlength=vocab_size)
        except (OSError, KeyError) as exc:
            raise TrainingDataError(f"{path}: cannot read input_ids/loss_mask ({type(exc).__name__}: {exc})") from None
    return counts


def choose_draft_ids(counts: np.ndarray, size: int) -> np.ndarray:
    """The ``size`` most frequent ids (ties: lower id first), sorted ascending."""
    if not 0 < size <= counts.shape[0]:
        raise ValueError(f"draft_vocab.size: expected 1..{counts.shape[0]} (the target vocabulary), got {size}")
    order = np.lexsort((np.arange(counts.shape[0]), -counts))
    return np.sort(order[:size])


def coverage(counts: np.ndarray, used: np.ndarray) -> float:
    total = int(counts.sum())
    return float(counts[used].sum()) / total if total else 0.0


@dataclass(frozen=True)
class DraftVocabResult:
    draft_vocab_size: int
    target_vocab_size: int
    coverage: float
    eval_coverage: float
    train_masked_tokens: int
    distinct_masked_ids: int
    training_data_version: str

    def manifest(self) -> dict[str, Any]:
        """The C4 manifest plus what the coverage was measured on."""
        return {
            "draft_vocab_size": self.draft_vocab_size,
            "target_vocab_size": self.target_vocab_size,
            "coverage": round(self.coverage, 6),
            "eval_coverage": round(self.eval_coverage, 6),
            "train_masked_tokens": self.train_masked_tokens,
            "distinct_masked_ids": self.distinct_masked_ids,
            "training_data_version": self.training_data_version,
        }

    def as_metadata(self) -> dict[str, Any]:
        """What the `draft_vocab` asset records: the manifest's figures."""
        return self.manifest()


def build_draft_vocab(
    training_data: Path, output: Path, size: int | None, target_vocab_size: int | None
) -> DraftVocabResult:
    """Count the train split's masked tokens, choose the draft ids, write ``d2t``/``t2d`` (C4)."""
    import torch

    data = TrainingData.open(training_data)
    vocab = target_vocab_size or data.vocab_size
    counts = masked_token_counts(data.shard_files("train"), vocab)
    draft_size = size or default_draft_vocab_size(vocab)
    used = choose_draft_ids(counts, draft_size)
    eval_counts = masked_token_counts(data.shard_files("eval"), vocab)
    result = DraftVocabResult(
        draft_vocab_size=draft_size,
        target_vocab_size=vocab,
        coverage=coverage(counts, used),
        eval_coverage=coverage(eval_counts, used),
        train_masked_tokens=int(counts.sum()),
        distinct_masked_ids=int((counts > 0).sum()),
        training_data_version=data.version(),
    )
    used_t = torch.from_numpy(used).to(torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used_t] = True
    save_draft_vocab(output, used_t - torch.arange(draft_size), t2d, result.manifest())
    return result
