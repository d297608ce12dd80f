"""The target loader and the local extraction path on the Kimi-like checkpoint: remote code only
with `target.trust_remote_code`, the language model's identity from the nested config, aux states
through the wrapped DeepSeek-V3 decoder, and a clear refusal of the INT4 release."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_pipeline.hidden_states.capture import batch_states, load_target, reference_states
from eagle3_pipeline.target.folder import TargetError, load_tokenizer
from eagle3_pipeline.target.weights import load_target_weights
from eagle3_pipeline.testing.kimi.fixture import TEXT_DIMS, VOCAB_SIZE

torch = pytest.importorskip("torch")


def test_without_trust_remote_code_every_load_names_the_setting(kimi_checkpoint: Path) -> None:
    with pytest.raises(
        TargetError, match=r"ships its own code \(auto_map in config.json\); set target.trust_remote_code: true"
    ):
        load_target(str(kimi_checkpoint), "kimi", "cpu", "float32", trust_remote_code=False)
    with pytest.raises(TargetError, match=r"tokenizer ships its own code .*set target.trust_remote_code: true"):
        load_tokenizer(str(kimi_checkpoint), trust_remote_code=False)


def test_extraction_loads_the_wrapped_language_model(kimi_checkpoint: Path) -> None:
    target = load_target(str(kimi_checkpoint), "kimi", "cpu", "float32", trust_remote_code=True)
    identity = target.identity
    assert (identity.num_layers, identity.hidden_size, identity.vocab_size) == (
        TEXT_DIMS["num_hidden_layers"],
        TEXT_DIMS["hidden_size"],
        VOCAB_SIZE,
    )
    sequences = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    batched = batch_states(target, [1, 3, 4], sequences)
    alone_aux, alone_hidden = reference_states(target, [1, 3, 4], sequences[1])
    aux, hidden = batched[1]
    assert aux.shape == (3, 3 * identity.hidden_size) and hidden.shape == (3, identity.hidden_size)
    assert torch.allclose(aux, alone_aux, atol=1e-5) and torch.allclose(hidden, alone_hidden, atol=1e-5)


def test_the_drafter_reads_the_prefixed_tensors(kimi_checkpoint: Path) -> None:
    weights = load_target_weights(kimi_checkpoint)
    assert weights.embedding.shape == weights.lm_head.shape == (VOCAB_SIZE, TEXT_DIMS["hidden_size"])
    assert not torch.equal(weights.embedding, weights.lm_head), "Kimi's lm_head is untied"
    assert weights.config["model_type"] == "deepseek_v3" and weights.config["rope_scaling"]["factor"] == 64.0


def test_the_int4_release_is_refused_with_the_backends_that_can(kimi_checkpoint_int4: Path) -> None:
    with pytest.raises(TargetError) as caught:
        load_target(str(kimi_checkpoint_int4), "kimi", "cpu", "float32", trust_remote_code=True)
    message = str(caught.value)
    print(message)
    assert "quantized (compressed-tensors)" in message and "SGLang" in message and "vLLM" in message
    assert "Traceback" not in message
