"""Rolling hidden-state windows: extract a window of train shards, train on it, delete it, continue.

Real parts throughout: the real `extract` phase with the embedded model (SmolLM2-135M-Instruct, the
stand-in for the 1T target) on real training_data shards, the real `train` phase (its embedding and
lm_head from the same model folder), real files; the target is loaded once per module and handed to
the phase (``run(spec, report, source)``). Kills are simulated by raising from the rolling
loop's callables at chosen moments (during extraction, during training after a mid-window
checkpoint, between the window's last checkpoint and the state record, during deletion), and once
by ``kill -9`` of a process running the loop; every resumed run must end with the same steps and
bit-identical weights as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from eagle3_pipeline.drafter.spec import TrainError, TrainSettings
from eagle3_pipeline.drafter.train.checkpoint import latest_checkpoint, load_checkpoint
from eagle3_pipeline.drafter.train.epochs import rolling_batches
from eagle3_pipeline.drafter.train.phase import run as train_run
from eagle3_pipeline.drafter.train.rolling import STATE_FILE, RollingError, read_state, run_rolling, tradeoff
from eagle3_pipeline.hidden_states.capture import Target, load_target
from eagle3_pipeline.hidden_states.extract import run as extract_run
from eagle3_pipeline.hidden_states.sharding import ROLLING_LAYOUT_FILE, extraction_progress, read_rolling_layout
from eagle3_pipeline.hidden_states.store import HiddenStateStore, save_draft_vocab
from eagle3_pipeline.testing.reporter import Recorder
from eagle3_pipeline.testing.tiny_store import make_vocab
from eagle3_pipeline.testing.train_settings import train_settings
from eagle3_pipeline.testing.training_data import sample_rows, write_training_data
from eagle3_pipeline_tests.pipeline_files import TINY_TARGET, write_pipeline

pytestmark = [pytest.mark.slow, pytest.mark.local_model]

REPO = Path(__file__).resolve().parents[3]
WINDOW = 1
EPOCHS = 2
# Two train shards (one per training_data file), two windows, three batches a window; checkpoints at
# every window's end and at step 5, inside the second window.
TRAIN = train_settings(
    ttt_steps=2, lr=1e-3, epochs=EPOCHS, batch_tokens=30, max_seq_len=32, checkpoint_every=5, log_every=1,
    eval_samples=1, seed=3, dtype="float32", keep_checkpoints=3,
    model={"num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 128},
)  # fmt: skip


class Killed(RuntimeError):
    """A simulated kill of the rolling run."""


@pytest.fixture(scope="module")
def target(local_model: Path) -> Target:
    return load_target(str(local_model), "SmolLM2-135M-Instruct", "cpu", "auto", False)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, local_model: Path) -> Path:
    folder = tmp_path_factory.mktemp("rolling")
    train = [sample_rows("a", 6, seed=1, max_len=14), sample_rows("b", 6, seed=2, max_len=14)]
    write_training_data(folder / "training_data", {"train": train, "eval": [sample_rows("e", 3, seed=3, max_len=14)]})
    counts: Counter[int] = Counter(t for shard in train for row in shard for t in row["input_ids"])
    d2t, t2d = make_vocab(counts, 49152, 64)
    save_draft_vocab(folder / "vocab", d2t, t2d, {"draft_vocab_size": 64, "target_vocab_size": 49152})
    return folder


class Phases:
    """The three callables over the real phases, in process; ``kill`` raises at a chosen moment."""

    def __init__(self, base: Path, run: Path, local_model: Path, target: Target, **train: Any) -> None:
        self.target = target
        self.store = run / "hidden_states"
        self.extract_spec = {
            "training_data": str(base / "training_data"), "output": str(self.store), "model": str(local_model),
            "target_name": "SmolLM2-135M-Instruct", "device": "cpu", "shard_tokens": 200, "spot_check_samples": 1,
            "rolling_window_shards": WINDOW,
        }  # fmt: skip
        self.train_spec = {
            "store": str(self.store), "draft_vocab": str(base / "vocab"), "target_weights": str(local_model),
            "run_dir": str(run / "drafter"), "export_dir": str(run / "export"), "settings": {**TRAIN, **train},
        }  # fmt: skip
        self.state = run / "drafter" / STATE_FILE
        self.kill: str | None = None
        self.calls: list[tuple[str, Any]] = []

    def hidden_states(self) -> dict[str, Any]:
        return extract_run(self.extract_spec, Recorder(), self.target)

    def extract(self, shards: list[str]) -> Mapping[str, Any]:
        self.calls.append(("extract", tuple(shards)))
        if self.kill == "extract":
            self.kill = None
            extract_run({**self.extract_spec, "shards": shards[:1]}, Recorder(), self.target)
            raise Killed("during extraction, after the window's first shard")
        return extract_run({**self.extract_spec, "shards": shards}, Recorder(), self.target)

    def train(self, epoch: int, window: int) -> Mapping[str, Any]:
        self.calls.append(("train", (epoch, window)))
        spec = {**self.train_spec, "rolling": {"epoch": epoch, "window": window}}
        if self.kill == "training":
            self.kill = None
            started = latest_checkpoint(Path(self.train_spec["run_dir"]))

            def stop_after_a_new_checkpoint(_: Mapping[str, Any]) -> None:
                if latest_checkpoint(Path(self.train_spec["run_dir"])) != started:
                    raise Killed("during training, after a checkpoint inside the window")

            train_run(spec, Recorder(stop_after_a_new_checkpoint))
        result = train_run(spec, Recorder())
        if self.kill == "recorded":
            self.kill = None
            raise Killed("after the window's last checkpoint, before the state records it")
        return result

    def delete(self, shards: list[str]) -> Mapping[str, Any]:
        self.calls.append(("delete", tuple(shards)))
        if self.kill == "delete":
            self.kill = None
            extract_run({**self.extract_spec, "delete_shards": shards[:1]}, Recorder())
            raise Killed("during deletion, after the window's first shard")
        return extract_run({**self.extract_spec, "delete_shards": shards}, Recorder())

    def roll(self) -> dict[str, Any]:
        layout = read_rolling_layout(self.store)
        return run_rolling(
            self.state,
            layout.windows,
            epochs=EPOCHS,
            extract=self.extract,
            train=self.train,
            delete=self.delete,
            report=Recorder(),
        )


def weights(run_dir: Path) -> dict[str, Any]:
    found = latest_checkpoint(run_dir)
    assert found is not None
    return load_checkpoint(found)[0]["model"]


@pytest.fixture(scope="module")
def unbroken(data: Path, local_model: Path, target: Target) -> tuple[Phases, dict[str, Any], dict[str, Any]]:
    phases = Phases(data, data / "unbroken", local_model, target)
    stored = phases.hidden_states()
    return phases, stored, phases.roll()


def test_hidden_states_in_rolling_mode_holds_the_eval_shards_and_the_layout_of_the_train_shards(
    unbroken: tuple[Phases, dict[str, Any], dict[str, Any]],
) -> None:
    phases, stored, _ = unbroken
    layout = read_rolling_layout(phases.store)
    assert stored["eval_samples"] == 3 and stored["train_samples"] == 0 and stored["spot_check_passed"]
    assert (
        HiddenStateStore(phases.store).manifest().shards
        == layout.eval_shards
        == [
            f"shard-{n:05d}"
            for n in range(stored["rolling_train_shards"], stored["rolling_train_shards"] + len(layout.eval_shards))
        ]
    )
    assert layout.windows == [["shard-00000"], ["shard-00001"]] and layout.eval_shards == ["shard-00002"]
    assert sum(r.length for r in layout.rows) == stored["rolling_train_tokens"] and len(layout.rows) == 12
    progress = extraction_progress(phases.store)
    assert (
        progress is not None and progress.finished
    )  # the stall sensor does not wait for train shards that come and go


def test_an_uninterrupted_rolling_run_trains_every_window_of_every_epoch_once_with_one_window_on_disk(
    unbroken: tuple[Phases, dict[str, Any], dict[str, Any]],
) -> None:
    phases, _, result = unbroken
    layout = read_rolling_layout(phases.store)
    segments, _ = rolling_batches(layout, TrainSettings(**TRAIN))
    windows = len(layout.windows)
    assert result["steps"] == result["total_steps"] == sum(len(segment) for segment in segments) and result["finished"]
    assert result["rolling_windows_trained"] == EPOCHS * windows
    assert [c for c in phases.calls if c[0] == "train"] == [
        ("train", (e, w)) for e in range(EPOCHS) for w in range(windows)
    ]
    assert result["rolling_peak_shard_files"] <= len(layout.eval_shards) + WINDOW
    assert sorted(p.name for p in phases.store.glob("shard-*.safetensors")) == [
        f"{n}.safetensors" for n in layout.eval_shards
    ]
    assert (Path(phases.train_spec["export_dir"]) / "model.safetensors").is_file()
    state = read_state(phases.state)
    assert state is not None and state["segment"] == EPOCHS * windows and state["step"] == result["steps"]


def test_kills_during_extraction_training_recording_and_deletion_resume_to_the_same_drafter(
    unbroken: tuple[Phases, dict[str, Any], dict[str, Any]], data: Path, local_model: Path, target: Target
) -> None:
    reference, _, expected = unbroken
    phases = Phases(data, data / "killed", local_model, target)
    phases.hidden_states()
    for kill in ("extract", "recorded", "delete", "training"):
        phases.kill = kill
        with pytest.raises(Killed):
            phases.roll()
    # Killed inside the second window (epoch 0, window 1): the first is done, the rest is not begun.
    for epoch, window in ((0, 0), (1, 1)):
        with pytest.raises(TrainError, match="would train a window twice or skip one"):
            train_run({**phases.train_spec, "rolling": {"epoch": epoch, "window": window}}, Recorder())
    result = phases.roll()
    assert result["steps"] == expected["steps"] and result["finished"]
    trained = [c[1] for c in phases.calls if c[0] == "train"]
    windows = len(read_rolling_layout(phases.store).windows)
    # Each window is asked for once, plus once again after each of the two kills during and after its
    # training (the trainer finds itself inside or at the end of that window; it never trains one twice).
    assert (
        sorted(set(trained)) == [(e, w) for e in range(EPOCHS) for w in range(windows)]
        and len(trained) == EPOCHS * windows + 2
    )
    assert result["rolling_peak_shard_files"] <= len(read_rolling_layout(phases.store).eval_shards) + WINDOW
    a, b = weights(Path(phases.train_spec["run_dir"])), weights(Path(reference.train_spec["run_dir"]))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_kill_9_of_the_rolling_loop_inside_a_window_resumes_to_the_same_drafter(
    unbroken: tuple[Phases, dict[str, Any], dict[str, Any]], data: Path, local_model: Path, target: Target
) -> None:
    reference, _, expected = unbroken
    phases = Phases(data, data / "kill9", local_model, target)
    phases.hidden_states()
    script = (
        "import sys; from pathlib import Path\n"
        "from eagle3_pipeline_tests.drafter.train.test_rolling import Phases, load_target\n"
        f"model = Path({str(local_model)!r})\n"
        f"Phases(Path({str(data)!r}), Path({str(data / 'kill9')!r}), model, load_target(str(model), "
        "'SmolLM2-135M-Instruct', 'cpu', 'auto', False)).roll()\n"
    )
    log = (data / "kill9.log").open("w")
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    inside = (
        Path(phases.train_spec["run_dir"]) / "checkpoints" / "step-00000005"
    )  # the checkpoint inside the second window
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and child.poll() is None and not inside.is_dir():
        time.sleep(0.02)
    killed = child.poll() is None
    if killed:
        os.kill(child.pid, signal.SIGKILL)
    child.wait()
    log.close()
    assert killed and child.returncode == -signal.SIGKILL, (data / "kill9.log").read_text()
    state = json.loads(phases.state.read_text())
    assert (state["segment"], state["stage"]) == (1, "train")  # killed while training the second window
    result = phases.roll()
    assert result["resumed_from_step"] is not None and result["steps"] == expected["steps"]
    a, b = weights(Path(phases.train_spec["run_dir"])), weights(Path(reference.train_spec["run_dir"]))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_normal_checkpoint_is_not_continued_as_a_rolling_one(
    unbroken: tuple[Phases, dict[str, Any], dict[str, Any]], data: Path, local_model: Path, target: Target
) -> None:
    phases = Phases(data, data / "normal", local_model, target, max_steps=1)
    normal = {k: v for k, v in phases.extract_spec.items() if k != "rolling_window_shards"}
    extract_run(normal, Recorder(), target)
    train_run(phases.train_spec, Recorder())  # a normal drafter over the whole store
    phases.hidden_states()  # the same store, now in rolling mode (its train shards are kept and reused)
    with pytest.raises(TrainError, match="made under other rolling"):
        phases.train(0, 0)
    extract_run(normal, Recorder(), target)  # back to a whole store: the rolling layout goes
    assert not (phases.store / ROLLING_LAYOUT_FILE).exists() and HiddenStateStore(phases.store).manifest().shards == [
        "shard-00000",
        "shard-00001",
        "shard-00002",
    ]
    other = phases.state.parent / "other.json"
    other.write_text('{"layout": "another", "segment": 0, "stage": "extract"}')
    with pytest.raises(RollingError, match="another rolling layout"):
        run_rolling(
            other,
            [["shard-00000"]],
            epochs=1,
            extract=phases.extract,
            train=phases.train,
            delete=phases.delete,
            report=Recorder(),
        )


def test_the_tradeoff_for_kimi() -> None:
    train, eval_ = 88_000 * 1_250 * 0.95, 88_000 * 1_250 * 0.05
    figures = tradeoff(
        train,
        eval_,
        bytes_per_token=57_349,
        shard_tokens=32_768,
        window_shards=16,
        epochs=10,
        extract_tokens_per_s=20_000,
    )
    assert figures.store_bytes == pytest.approx(6.31e12, rel=1e-2)
    assert figures.rolling_peak_bytes < figures.store_bytes / 15
    assert figures.extract_ratio == pytest.approx((10 * 0.95 + 0.05) / 1.0)


def test_the_assets_in_rolling_mode_extract_train_and_delete_window_by_window(
    tmp_path: Path, local_model: Path
) -> None:
    """hidden_states, draft_vocab, eagle3_drafter and drafter_eval on a real ephemeral Dagster
    instance, compute local (the phases in process; the embedded model is the target)."""
    import dagster as dg

    from eagle3_pipeline.components.eagle3.drafter_eval import build_drafter_eval
    from eagle3_pipeline.components.eagle3.eagle3_drafter import build_drafter_assets
    from eagle3_pipeline.components.eagle3.hidden_states import build_eagle3_assets
    from eagle3_pipeline.config import load_config
    from eagle3_pipeline.drafter.spec import drafter_paths
    from eagle3_pipeline_tests.dagster_runs import pipeline_resources

    drafter = {
        "ttt_steps": 2,
        "epochs": 1,
        "batch_tokens": 30,
        "max_seq_len": 32,
        "checkpoint_every": 50,
        "log_every": 1,
        "eval_samples": 1,
        "model": {"num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 128},
    }
    sections = {
        "hidden_states": {"shard_tokens": 200, "spot_check_samples": 1, "device": "cpu", "rolling_window_shards": 1},
        "draft_vocab": {"size": 256},
        "drafter": drafter,
    }
    path = write_pipeline(tmp_path, TINY_TARGET, sections)
    config = load_config(path)
    train = [sample_rows("a", 3, seed=1, max_len=12), sample_rows("b", 3, seed=2, max_len=12)]
    write_training_data(
        config.artifacts_root / "training_data", {"train": train, "eval": [sample_rows("e", 1, seed=3, max_len=12)]}
    )
    assets = [*build_eagle3_assets(config), *build_drafter_assets(config), *build_drafter_eval(config)]
    result = dg.materialize(assets, instance=dg.DagsterInstance.ephemeral(), resources=pipeline_resources(path))
    assert result.success
    states = result.asset_materializations_for_node("hidden_states")[0].metadata
    assert (
        states["train_samples"].value == 0
        and states["eval_samples"].value == 1
        and states["rolling_train_shards"].value == 2
    )
    drafter = result.asset_materializations_for_node("eagle3_drafter")[0].metadata
    assert (
        drafter["rolling_windows_trained"].value == 2
        and drafter["steps"].value == drafter["total_steps"].value
        and drafter["steps"].value
    )
    assert drafter["rolling_peak_shard_files"].value == 2  # the eval shard and one window
    paths = drafter_paths(config.artifacts_root)
    assert [p.name for p in paths["store"].glob("shard-*.safetensors")] == ["shard-00002.safetensors"]
    assert (paths["export_dir"] / "model.safetensors").is_file() and (paths["run_dir"] / STATE_FILE).is_file()
    evaluated = result.asset_materializations_for_node("drafter_eval")[0].metadata
    assert any(
        key.startswith("tau@") for key in evaluated
    )  # the eval shards stayed; the bigram counted training_data's train split


def test_rolling_with_the_users_extraction_command_is_refused_by_name(tmp_path: Path) -> None:
    from eagle3_pipeline.config import ConfigError, load_config

    command = {
        "kind": "command",
        "host": {"hostname": "h"},
        "workdir": "/w",
        "artifacts_root": "/a",
        "command": "extract {spec}",
    }
    path = write_pipeline(tmp_path, {"hidden_states": {"rolling_window_shards": 4}, "compute": command})
    with pytest.raises(
        ConfigError, match="hidden_states.rolling_window_shards: not supported with compute.kind 'command'"
    ):
        load_config(path)
