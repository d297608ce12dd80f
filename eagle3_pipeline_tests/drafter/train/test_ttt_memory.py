"""The memory-bounded training-time test equals the full-score pass it replaced.

``reference_ttt_forward`` and ``reference_ttt_loss`` (:mod:`eagle3_pipeline.testing.drafter_reference`) are
the drafter's TTT pass and loss as they were before the blockwise attention (model.py and train.py at
commit 04fe7eb), over the same modules:
per step a [B, heads, T, T] score tensor against the step-0 keys, the diagonal scores concatenated
to it, one softmax; the loss's log-softmax and soft labels as whole [N, Vd] float32 tensors.
``benchmarks/drafter_train.py --memory`` measures them as the old pass.

Tolerance: float32; per tensor (each step's logits, each parameter's gradient) the largest absolute
difference is at most 1e-5 of the tensor's largest magnitude. The two passes sum the same terms in
another order (an online softmax over key blocks, exp(L_c − L)·out_c instead of one normalisation;
a gradient sums over every position, so an element-wise rtol would judge its small elements by the
rounding of large sums); the largest differences found are printed (``-s``): at most 5.7e-7 of the
tensor's scale here (logits: 1.2e-6 on magnitudes ~4; gradients: 9.9e-5 on magnitudes up to ~500). A
lost term (a padding key seen, a diagonal key, the log-sum-exp's gradient or a block's rescaling
dropped, the causal edge moved) fails these tests (each was tried).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
import torch

F = torch.nn.functional

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import eagle3_pipeline.drafter.model.attention as attention_module
import eagle3_pipeline.drafter.model.eagle3 as model_module
import eagle3_pipeline.drafter.train.loss as loss_module
from eagle3_pipeline.drafter.model.draft_config import DrafterConfig, yarn_for_servers
from eagle3_pipeline.drafter.model.eagle3 import Eagle3Drafter
from eagle3_pipeline.drafter.train.data import Batch
from eagle3_pipeline.drafter.train.loss import soft_label_cross_entropy, ttt_loss
from eagle3_pipeline.testing.drafter_reference import reference_ttt_forward, reference_ttt_loss

TOLERANCE = 1e-5  # of each tensor's largest magnitude
STEPS = 4


def _config(**overrides: Any) -> DrafterConfig:
    base: dict[str, Any] = dict(
        hidden_size=48, target_hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=2,
        head_dim=8, vocab_size=80, draft_vocab_size=24, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=4096, aux_layer_ids=[1, 3, 4],
    )  # fmt: skip
    base.update(overrides)
    return DrafterConfig(**base)


CONFIGS = {
    "gqa": _config(),
    "mha": _config(num_key_value_heads=6),
    "yarn-one-kv-head": _config(
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        rope_theta=50000.0,
        rope_scaling=yarn_for_servers(
            {
                "type": "yarn",
                "factor": 64.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            "test",
        ),
    ),  # fmt: skip
}


def _model(config: DrafterConfig) -> Eagle3Drafter:
    torch.manual_seed(0)
    model = Eagle3Drafter(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model.embed_tokens.weight.requires_grad_(False)  # the target's, frozen, as SpecForge freezes it
    used = torch.sort(torch.randperm(config.vocab_size)[: config.draft_vocab_size]).values
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[used] = True
    model.set_vocab(used - torch.arange(config.draft_vocab_size), t2d)
    return model


def _batch(config: DrafterConfig, lengths: list[int], seed: int = 1) -> Batch:
    """Right-padded batch (as BatchReader pads): real tokens up to each length, a prompt not trained."""
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    real = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    loss_mask = real & (torch.arange(t)[None, :] >= 3)
    return Batch(
        aux=torch.randn(b, t, 3 * config.target_hidden_size, generator=g),
        hidden=torch.randn(b, t, config.target_hidden_size, generator=g) * 3,
        input_ids=torch.randint(0, config.vocab_size, (b, t), generator=g) * real,
        loss_mask=loss_mask,
        attention_mask=real,
    )


def _lm_head(config: DrafterConfig, model: Eagle3Drafter) -> torch.Tensor:
    """A target head whose argmax mostly falls in the draft vocabulary (most positions count)."""
    g = torch.Generator().manual_seed(2)
    return torch.randn(config.vocab_size, config.target_hidden_size, generator=g) * (1 + 2 * model.t2d.float()[:, None])


def _grads(model: Eagle3Drafter, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def _differences(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """Per tensor: the largest absolute difference and that divided by the tensor's largest magnitude."""
    assert ours.keys() == theirs.keys()
    out = {}
    for name in ours:
        largest = float((ours[name].detach() - theirs[name].detach()).abs().max())
        out[name] = (largest, largest / max(float(theirs[name].detach().abs().max()), 1e-30))
    return out


def _assert_close(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], what: str) -> None:
    differences = _differences(ours, theirs)
    worst = max(differences, key=lambda name: differences[name][1])
    print(
        f"-- {what}: largest difference {max(d[0] for d in differences.values()):.2e}; relative to the tensor's scale "
        f"{differences[worst][1]:.2e} ({worst})"
    )
    bad = {name: d for name, d in differences.items() if d[1] > TOLERANCE}
    assert not bad, f"{what}: differences beyond {TOLERANCE} of the tensor's scale: {bad}"


BLOCKINGS = {
    # query rows per block, scores per key block (at least one query block's rows)
    "q8-k8": (8, 1),
    "q8-k-unaligned": (8, 3 * 6 * 8 * 20),  # key blocks of 16 or 24 rows: causal edges inside them
    "q8-one-key-block": (8, 1 << 40),
    "default": (attention_module.ATTENTION_BLOCK, attention_module.ATTENTION_SCORE_ELEMENTS),
}


@pytest.fixture(params=list(BLOCKINGS))
def blocking(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Blocks of 8 query rows cut the short sequences here into many, against key blocks of as many
    rows, of other sizes, or all keys at once; the default blocking with a sequence longer than a block
    checks the real setting."""
    rows, scores = BLOCKINGS[request.param]
    monkeypatch.setattr(attention_module, "ATTENTION_BLOCK", rows)
    monkeypatch.setattr(attention_module, "ATTENTION_SCORE_ELEMENTS", scores)
    return str(request.param)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_every_gradient_equal_the_full_score_pass(name: str, blocking: str) -> None:
    config = CONFIGS[name]
    model = _model(config)
    rows = BLOCKINGS[blocking][0]
    longest = 45 if rows == 8 else rows + 37
    batch = _batch(config, [longest, longest - 17, 9])  # padding in two of three rows; a row shorter than a block
    g = torch.Generator().manual_seed(3)
    cotangents = [torch.randn(batch.input_ids.shape + (config.draft_vocab_size,), generator=g) for _ in range(STEPS)]

    ours = model.ttt_forward(batch.aux, batch.input_ids, STEPS, batch.attention_mask)
    theirs = reference_ttt_forward(model, batch.aux, batch.input_ids, STEPS, batch.attention_mask)
    ours_grads = _grads(model, torch.stack([(o * c).sum() for o, c in zip(ours, cotangents, strict=True)]).sum())
    theirs_grads = _grads(model, torch.stack([(o * c).sum() for o, c in zip(theirs, cotangents, strict=True)]).sum())
    print()
    _assert_close(
        {f"logits of step {j}": o for j, o in enumerate(ours)},
        {f"logits of step {j}": o for j, o in enumerate(theirs)},
        f"{name}, {blocking}, logits",
    )
    assert set(ours_grads) == {n for n, p in model.named_parameters() if p.requires_grad}
    _assert_close(ours_grads, theirs_grads, f"{name}, {blocking}, gradients")


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
@pytest.mark.parametrize("name", ["gqa", "yarn-one-kv-head"])
def test_the_training_loss_and_its_gradients_equal_the_full_score_loss(
    name: str, checkpointing: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """loss.ttt_loss (blockwise attention, chunked soft-label loss, optionally the decoder layer
    recomputed in the backward) against the loss of before, with the real teacher on a padded batch."""
    monkeypatch.setattr(attention_module, "ATTENTION_BLOCK", 8)
    monkeypatch.setattr(attention_module, "ATTENTION_SCORE_ELEMENTS", 1)
    monkeypatch.setattr(loss_module, "LOSS_CHUNK_ELEMENTS", 5 * CONFIGS[name].draft_vocab_size)  # chunks of 5 rows
    config = CONFIGS[name]
    model = _model(config)
    lm_head = _lm_head(config, model)
    batch = _batch(config, [40, 23, 31], seed=4)
    ours = ttt_loss(model, batch, lm_head=lm_head, steps=STEPS, activation_checkpointing=checkpointing)
    assert int(ours.trained.sum()) > 0
    ours_grads = _grads(model, ours.loss)
    theirs = reference_ttt_loss(model, batch, lm_head, STEPS)
    theirs_grads = _grads(model, theirs)
    print(
        f"\n-- {name}, checkpointing {checkpointing}: loss {float(ours.loss.detach()):.7f}, "
        f"full-score loss {float(theirs.detach()):.7f}"
    )
    _assert_close({"loss": ours.loss}, {"loss": theirs}, f"{name}, checkpointing {checkpointing}, loss")
    _assert_close(ours_grads, theirs_grads, f"{name}, checkpointing {checkpointing}, gradients")


def test_the_chunked_soft_label_loss_equals_the_whole_product() -> None:
    """Against the whole [N, Vd] product, in chunks of every size; the labels are not distributions
    (rows summing to anything), so the gradient's softmax · Σ_v p term is checked too."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(23, 40, generator=g) * 4).requires_grad_()
    probs = torch.rand(50, 40, generator=g)
    rows = torch.randint(0, 50, (23,), generator=g)
    whole = -(probs[rows] * torch.log_softmax(logits, dim=-1)).sum()
    (expected,) = torch.autograd.grad(whole, logits)
    for chunk_rows in (1, 4, 23, 100):
        chunked = soft_label_cross_entropy(logits, probs, rows, chunk_rows)
        (grad,) = torch.autograd.grad(chunked, logits)
        _assert_close(
            {"loss": chunked, "gradient": grad}, {"loss": whole, "gradient": expected}, f"chunks of {chunk_rows} rows"
        )


class _LargestTensor(TorchDispatchMode):
    """The largest tensor any operation produces (forward and backward) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.shape: tuple[int, ...] = ()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.numel() > self.largest:
                self.largest, self.shape = tensor.numel(), tuple(tensor.shape)
        return out


def _largest_tensor_of_a_training_step(forward: Any, model: Eagle3Drafter, batch: Batch) -> tuple[int, tuple[int, ...]]:
    with _LargestTensor() as seen:
        logits = forward(model, batch.aux, batch.input_ids, STEPS, batch.attention_mask)
        torch.stack([step.sum() for step in logits]).sum().backward()
    return seen.largest, seen.shape


def test_no_step_makes_a_tensor_of_sequence_squared_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor of a training step (forward and backward, all steps) stays below one head's
    T×T scores: the blocks' scores are B·heads·block², the rest linear in T. The same check sees
    the full-score pass's [B, heads, T, T] scores."""
    monkeypatch.setattr(attention_module, "ATTENTION_BLOCK", 16)
    monkeypatch.setattr(attention_module, "ATTENTION_SCORE_ELEMENTS", 1)
    config = _config(
        hidden_size=16,
        target_hidden_size=16,
        intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        vocab_size=40,
        draft_vocab_size=8,
    )
    model = _model(config)
    t = 160
    batch = _batch(config, [t, t - 30])
    ours, ours_shape = _largest_tensor_of_a_training_step(Eagle3Drafter.ttt_forward, model, batch)
    theirs, theirs_shape = _largest_tensor_of_a_training_step(reference_ttt_forward, model, batch)
    print(f"\n-- largest tensor of a training step: blockwise {ours_shape}, full-score {theirs_shape}")
    assert theirs >= 2 * config.num_attention_heads * t * t
    assert ours < t * t, ours_shape


def test_the_activation_checkpointing_setting_reaches_the_training_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`drafter.activation_checkpointing` goes through the train spec into TrainSettings, and the
    training loop then runs every TTT step's decoder layer under torch.utils.checkpoint."""
    from eagle3_pipeline.config import load_config
    from eagle3_pipeline.drafter.spec import TrainSettings, train_spec
    from eagle3_pipeline.drafter.train.phase import run
    from eagle3_pipeline.testing.reporter import Recorder
    from eagle3_pipeline.testing.train_settings import random_store_train_spec

    pipeline = load_config(None, runtime_checks=False)
    pipeline = pipeline.model_copy(
        update={
            "drafter": pipeline.drafter.model_copy(
                update={"target_weights": "/models/t", "activation_checkpointing": True}
            )
        }
    )
    settings = train_spec(pipeline)["settings"]
    assert settings["activation_checkpointing"] is True and TrainSettings(**settings).activation_checkpointing

    calls: list[bool] = []

    def counted(function: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(torch.is_grad_enabled())
        return checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(model_module, "checkpoint", counted)
    result = run(
        random_store_train_spec(tmp_path, activation_checkpointing=True, epochs=1, max_steps=2, checkpoint_every=100),
        Recorder(),
    )
    assert result["steps"] == 2 and calls == [True] * 2 * 3  # 2 training steps × ttt_steps 3; evaluation runs without
