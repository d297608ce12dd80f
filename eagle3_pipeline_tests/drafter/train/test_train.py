"""The train phase: checkpoints, a rerun that is a no-op, resume after kill -9, vocab guard.

The target here is a small made-up one (random tied embedding, random states; see tiny_store) so a
whole run takes seconds; the real tiny model is used in test_train_local_model.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from eagle3_pipeline.drafter.export.specforge import load_export
from eagle3_pipeline.drafter.spec import TrainError
from eagle3_pipeline.drafter.train.checkpoint import latest_checkpoint, load_checkpoint
from eagle3_pipeline.drafter.train.phase import run
from eagle3_pipeline.hidden_states.store import save_draft_vocab
from eagle3_pipeline.testing.reporter import Recorder
from eagle3_pipeline.testing.train_settings import random_store_train_spec

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]


def test_a_run_checkpoints_exports_and_a_rerun_is_a_no_op(tmp_path: Path) -> None:
    spec = random_store_train_spec(tmp_path)
    report = Recorder()
    result = run(spec, report)
    assert result["steps"] == result["total_steps"] > 4
    assert [p["step"] for p in report.points] == [row["step"] for row in result["curve"]]
    assert {"loss", "lr", "acc_0", "acc_1", "acc_2", "tokens_per_s"} <= set(result["curve"][0])
    assert result["evals"][-1]["step"] == result["steps"] and "eval_acc_2" in result["evals"][-1]
    found = latest_checkpoint(tmp_path / "run")
    assert found is not None and found.name == f"step-{result['steps']:08d}"
    assert len(list((tmp_path / "run" / "checkpoints").iterdir())) == 2  # keep_checkpoints
    state, d2t, _ = load_checkpoint(found)
    assert "embed_tokens.weight" not in state["model"] and torch.equal(
        d2t, load_export(tmp_path / "export", tmp_path / "target").d2t
    )
    again = run(spec, Recorder())
    assert again["resumed_from_step"] == result["steps"] and again["trained_tokens_this_run"] == 0
    assert again["curve"] == result["curve"]


def test_kill_9_mid_training_resumes_from_the_last_checkpoint_and_ends_where_an_unbroken_run_does(
    tmp_path: Path,
) -> None:
    spec = random_store_train_spec(tmp_path / "a", epochs=3, checkpoint_every=3, batch_tokens=64)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    script = (
        "import json, sys; from eagle3_pipeline.drafter.train.phase import run\n"
        "class R:\n def log(self, m): print(m, flush=True)\n def progress(self, m): pass\n"
        f"run(json.load(open({str(spec_file)!r})), R())\n"
    )
    log = (tmp_path / "child.log").open("w")
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    killed_after = None
    while time.monotonic() < deadline and child.poll() is None:
        found = latest_checkpoint(Path(spec["run_dir"]))
        if found is not None and int(found.name.split("-")[1]) >= 9:
            os.kill(child.pid, signal.SIGKILL)
            killed_after = int(found.name.split("-")[1])
            break
        time.sleep(0.02)
    if child.poll() is None and killed_after is None:
        child.kill()
    child.wait()
    log.close()
    assert child.returncode == -signal.SIGKILL and killed_after is not None, (tmp_path / "child.log").read_text()
    last = latest_checkpoint(Path(spec["run_dir"]))
    assert last is not None and killed_after is not None
    last_step = int(last.name.split("-")[1])
    report = Recorder()
    resumed = run(spec, report)
    assert resumed["resumed_from_step"] == last_step >= killed_after
    assert f"resuming from step-{last_step:08d}" in report.lines[0]
    unbroken_spec = random_store_train_spec(tmp_path / "a", epochs=3, checkpoint_every=3, batch_tokens=64)
    unbroken_spec.update(run_dir=str(tmp_path / "b" / "run"), export_dir=str(tmp_path / "b" / "export"))
    unbroken = run(unbroken_spec, Recorder())
    assert resumed["steps"] == unbroken["steps"]
    assert resumed["curve"][-1]["loss"] == unbroken["curve"][-1]["loss"]
    a, _, _ = load_checkpoint(latest_checkpoint(Path(spec["run_dir"])))  # type: ignore[arg-type]
    b, _, _ = load_checkpoint(latest_checkpoint(tmp_path / "b" / "run"))  # type: ignore[arg-type]
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name


def test_a_torn_checkpoint_is_ignored(tmp_path: Path) -> None:
    spec = random_store_train_spec(tmp_path, epochs=1)
    first = run(spec, Recorder())
    torn = tmp_path / "run" / "checkpoints" / "step-99999999"
    torn.mkdir()
    (torn / "state.pt").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path / "run") == tmp_path / "run" / "checkpoints" / f"step-{first['steps']:08d}"


def test_resuming_with_another_draft_vocabulary_is_refused(tmp_path: Path) -> None:
    spec = random_store_train_spec(tmp_path, epochs=1)
    run(spec, Recorder())
    vocab = tmp_path / "vocab"
    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[50:90] = True
    save_draft_vocab(vocab, torch.full((40,), 50, dtype=torch.int64), t2d, {"draft_vocab_size": 40})
    with pytest.raises(TrainError, match="another draft vocabulary"):
        run(spec, Recorder())


def test_resuming_under_other_settings_is_refused(tmp_path: Path) -> None:
    run(random_store_train_spec(tmp_path, epochs=1), Recorder())
    with pytest.raises(TrainError, match="settings"):
        run(random_store_train_spec(tmp_path, epochs=1, lr=1e-2), Recorder())


def test_a_spec_with_an_unknown_setting_is_named(tmp_path: Path) -> None:
    with pytest.raises(TrainError, match="learning_rate"):
        run(random_store_train_spec(tmp_path, learning_rate=1.0), Recorder())


def test_the_teacher_on_trained_indices_only_gives_the_loss_of_the_full_teacher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The teacher is computed only where the next token is trained; with prompt tokens and padding in
    the batch, loss, per-step losses and hits are those of the teacher computed everywhere."""
    import eagle3_pipeline.drafter.train.loss as loss
    from eagle3_pipeline.drafter.model.draft_config import drafter_config
    from eagle3_pipeline.drafter.train.data import BatchReader, epoch_batches, store_rows, teacher
    from eagle3_pipeline.drafter.train.phase import build_model
    from eagle3_pipeline.hidden_states.store import HiddenStateStore, load_draft_vocab
    from eagle3_pipeline.target.weights import load_target_weights

    spec = random_store_train_spec(tmp_path)
    store = HiddenStateStore(Path(spec["store"]))
    d2t, t2d, _ = load_draft_vocab(Path(spec["draft_vocab"]))
    target = load_target_weights(Path(spec["target_weights"]))
    config = drafter_config(target.config, int(d2t.shape[0]), list(store.manifest().aux_layer_ids), {})
    model = build_model(config, target, d2t, t2d, seed=0)
    [rows, *_] = epoch_batches(store_rows(store, "train"), 0, 0, 96, 32)
    batch = BatchReader(store.root, 32).read(rows)
    assert len(rows) > 1 and not batch.attention_mask.all(), "the batch has padding"
    batch.loss_mask[:, : batch.loss_mask.shape[1] // 2] = False  # a prompt: its tokens are not trained

    partial = loss.ttt_loss(model, batch, lm_head=target.lm_head, steps=3)
    monkeypatch.setattr(loss, "teacher", lambda hidden, lm_head, t2d, needed=None: teacher(hidden, lm_head, t2d))
    everywhere = loss.ttt_loss(model, batch, lm_head=target.lm_head, steps=3)
    assert int(partial.trained.sum()) > 0
    assert torch.allclose(partial.loss, everywhere.loss) and torch.allclose(partial.step_losses, everywhere.step_losses)
    assert torch.equal(partial.hits, everywhere.hits) and torch.equal(partial.trained, everywhere.trained)
