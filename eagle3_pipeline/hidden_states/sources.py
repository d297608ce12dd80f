"""Where the `extract` phase's states come from: the :class:`StateSource` each backend implements
(transformers in process, SGLang's model runner under tensor parallelism, a vLLM server), the one
the spec names (:func:`open_source`), and how the writer's decisions reach every rank (:func:`decided`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

from eagle3_pipeline.hidden_states.capture import load_target
from eagle3_pipeline.hidden_states.extract_spec import ExtractionError, ExtractSpec, aux_layer_ids
from eagle3_pipeline.hidden_states.store import StoreError, TargetIdentity

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


@contextmanager
def open_source(settings: ExtractSpec) -> Iterator[StateSource]:
    """The state source ``hidden_states.backend`` names, on this process (one rank under torchrun)."""
    if settings.backend == "sglang":
        from eagle3_pipeline.hidden_states.sglang_capture import open_sglang_target

        if settings.mem_fraction_static == "auto":
            raise ExtractionError(
                "hidden_states.mem_fraction_static is auto but was not chosen: the GPUs' memory was unknown at the "
                "phase's preflight (machine.check off, or nvidia-smi did not answer); set a number or machine.gpu"
            )
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


def decided(source: StateSource, decide: Callable[[], T]) -> T:
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
