"""Hidden states from a vLLM server started for extraction: the state source of
``hidden_states.backend: vllm`` (:func:`open_vllm_target`).

The server, already started with vLLM's ``extract_hidden_states`` method and its hidden-states
connector, must run exactly the store's layer ids (proven before the first request); each sample is
one completion of our token ids, whose states the connector writes to a file read here and deleted.
The teacher is the target's final RMSNorm applied here to the last layer's state. The flags, the
files and why: hidden_states/DESIGN.md "A vLLM extraction server". httpx and torch are imported
inside the functions that use them.
"""

from __future__ import annotations

import fcntl
import shlex
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from eagle3_pipeline.hidden_states.capture import SampleError, TargetLoadError, target_identity
from eagle3_pipeline.hidden_states.store import TargetIdentity
from eagle3_pipeline.hidden_states.vllm_server import extraction_url, served_layer_ids
from eagle3_pipeline.managed.launch import extraction_args
from eagle3_pipeline.target.folder import drafter_tensor_names, read_config, read_tensors, text_config
from eagle3_pipeline.target.layer_ids import extraction_layer_ids, target_family

URL_SETTING = "hidden_states.vllm_base_url"
DIR_SETTING = "hidden_states.vllm_output_dir"
FILE_WAIT_S = 120.0  # how long a request's file may take to appear after its response
REQUEST_TIMEOUT_S = 600.0


class VllmError(TargetLoadError):
    """The vLLM server cannot give the states as set up; the message names the setting to change."""


def rms_norm(states: Any, weight: Any, eps: float) -> Any:
    """The target's final norm, computed as transformers' ``LlamaRMSNorm`` / DeepSeek-V3's ``RMSNorm``."""
    import torch

    dtype = states.dtype
    x = states.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def first_difference(found: Sequence[int], expected: Sequence[int]) -> int | None:
    """The first position where two id lists differ (the shorter one's length if one is a prefix), else None."""
    for position, (a, b) in enumerate(zip(found, expected, strict=False)):
        if a != b:
            return position
    return None if len(found) == len(expected) else min(len(found), len(expected))


class VllmTarget:
    """A vLLM server as a state source of the `extract` loop
    (:class:`eagle3_pipeline.hidden_states.extract.StateSource`); this process writes."""

    writer = True
    spot_check_method = "alone: the same request sent again to the vLLM server"

    def __init__(
        self,
        http: Any,
        base_url: str,
        *,
        served: str,
        output_dir: Path,
        identity: TargetIdentity,
        family: str,
        norm_name: str,
        norm: Any,
        eps: float,
        parallel: int,
    ) -> None:
        self.http = http
        self.base_url = base_url
        self.served = served
        self.output_dir = output_dir
        self.identity = identity
        self.family = family
        self.norm_name = norm_name
        self.norm = norm
        self.eps = eps
        self.parallel = parallel
        self.layer_evidence = "layer ids not checked"

    def describe(self) -> str:
        return f"the vLLM server at {self.base_url} ({self.served}, extract_hidden_states; {self.layer_evidence})"

    def server_layers(self, aux_layer_ids: Sequence[int]) -> list[int]:
        """vLLM's ``eagle_aux_hidden_state_layer_ids`` for our ids: inputs of layers id + 1, then N."""
        return extraction_layer_ids(self.family, aux_layer_ids, self.identity.num_layers)

    def check_layers(self, aux_layer_ids: Sequence[int]) -> None:
        """Prove that the server was started with :meth:`server_layers` (from its command line here,
        :func:`eagle3_pipeline.hidden_states.vllm_server.served_layer_ids`), or refuse with
        :class:`VllmError` naming the ids and the flags to start it with."""
        expected = self.server_layers(aux_layer_ids)
        url = urlsplit(self.base_url)
        found = served_layer_ids(url.hostname or "", url.port or (443 if url.scheme == "https" else 80))
        if isinstance(found, tuple) and found[0] == expected:
            self.layer_evidence = f"layer ids {expected} read from the command line of pid {found[1]}"
            return
        why = (
            f"the server (pid {found[1]}) was started with eagle_aux_hidden_state_layer_ids {found[0]}"
            if isinstance(found, tuple)
            else f"its layer ids cannot be proven: {found}"
        )
        raise VllmError(
            f"{URL_SETTING} {self.base_url!r}: {why}; the store's aux layers {list(aux_layer_ids)} (output of layer) "
            f"and teacher (layer {self.identity.num_layers}) need eagle_aux_hidden_state_layer_ids {expected}: "
            f"start the server with {shlex.join(extraction_args(expected, self.output_dir))}"
        )

    def capture(self, aux_layer_ids: Sequence[int]) -> dict[str, Any]:
        return {
            "backend": "vllm",
            "server_model": self.served,
            "family": self.family,
            "eagle_aux_hidden_state_layer_ids": self.server_layers(aux_layer_ids),
            "teacher_norm": f"{self.norm_name} applied by the extractor to layer {self.identity.num_layers}'s state",
            "rms_norm_eps": self.eps,
        }

    def share(self, value: Any) -> Any:
        return value

    def batch_states(self, aux_layer_ids: Sequence[int], sequences: Sequence[Sequence[int]]) -> list[tuple[Any, Any]]:
        """``(aux [T, 3H], hidden [T, H])`` per sequence, one request each (up to ``parallel`` at once)."""
        jobs = list(enumerate(sequences))
        with ThreadPoolExecutor(max_workers=max(1, min(self.parallel, len(jobs)))) as pool:
            return list(pool.map(lambda job: self._states(aux_layer_ids, job[0], job[1]), jobs))

    def reference_states(self, aux_layer_ids: Sequence[int], sequence: Sequence[int]) -> tuple[Any, Any]:
        return self._states(aux_layer_ids, 0, sequence)

    def _complete(self, index: int, sequence: Sequence[int]) -> dict[str, Any]:
        import httpx

        body = {
            "model": self.served,
            "prompt": list(sequence),
            "max_tokens": 1,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        try:
            reply = self.http.post(f"{self.base_url}/completions", json=body)
        except httpx.HTTPError as exc:
            raise VllmError(
                f"{URL_SETTING} {self.base_url!r}: POST /completions failed ({type(exc).__name__}: {exc})"
            ) from None
        if reply.status_code != 200:
            raise SampleError(
                index, f"vLLM answered POST /completions with HTTP {reply.status_code}: {reply.text[:300]}"
            )
        payload: dict[str, Any] = reply.json()
        return payload

    def _states(self, aux_layer_ids: Sequence[int], index: int, sequence: Sequence[int]) -> tuple[Any, Any]:
        payload = self._complete(index, sequence)
        path = (payload.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise VllmError(
                f"{URL_SETTING} {self.base_url!r}: the completion has no kv_transfer_params.hidden_states_path; "
                "expected a server started with --kv-transfer-config naming ExampleHiddenStatesConnector"
            )
        tensors = take_file(self.output_dir / Path(str(path)).name)
        choices = payload.get("choices") or [{}]
        prompt_ids = choices[0].get("prompt_token_ids")
        if prompt_ids is None:
            raise VllmError(
                f"{URL_SETTING} {self.base_url!r}: the completion has no prompt_token_ids; expected a vLLM "
                "server that honours return_token_ids"
            )
        position = first_difference(prompt_ids, sequence)
        if position is not None:
            raise SampleError(
                index,
                f"vLLM's prompt_token_ids differ from our input_ids at position {position} "
                f"(server {prompt_ids[position : position + 3]}, ours {list(sequence[position : position + 3])}; "
                f"{len(prompt_ids)} vs {len(sequence)} tokens): the server must take the ids as given",
            )
        return self._split(aux_layer_ids, index, sequence, tensors)

    def _split(
        self, aux_layer_ids: Sequence[int], index: int, sequence: Sequence[int], tensors: dict[str, Any]
    ) -> tuple[Any, Any]:
        import torch

        states, ids = tensors.get("hidden_states"), tensors.get("token_ids")
        if states is None or ids is None:
            raise VllmError(f"{DIR_SETTING}: a connector file lacks hidden_states or token_ids (has {sorted(tensors)})")
        layers = len(aux_layer_ids) + 1
        expected = (len(sequence), layers, self.identity.hidden_size)
        if tuple(states.shape) != expected:
            raise VllmError(
                f"{URL_SETTING}: the connector wrote hidden_states of shape {list(states.shape)}, expected "
                f"{list(expected)} (tokens, layers, hidden): start the server with eagle_aux_hidden_state_layer_ids "
                f"{self.server_layers(aux_layer_ids)}"
            )
        position = first_difference([int(i) for i in ids.tolist()], sequence)
        if position is not None:
            raise SampleError(index, f"the connector file's token_ids differ from our input_ids at position {position}")
        aux = torch.cat([states[:, k] for k in range(len(aux_layer_ids))], dim=-1)
        hidden = rms_norm(states[:, -1], self.norm.to(states.dtype), self.eps)
        return aux, hidden


def take_file(path: Path) -> dict[str, Any]:
    """The connector's file at ``path`` once its writer is done (module docstring), deleted with its lock."""
    from safetensors.torch import load_file

    lock = Path(f"{path}.lock")
    deadline = time.monotonic() + FILE_WAIT_S
    while not (path.is_file() or lock.is_file()):
        if time.monotonic() > deadline:
            raise VllmError(
                f"{DIR_SETTING} {str(path.parent)!r}: no {path.name} after {FILE_WAIT_S:.0f} s; expected the "
                "folder the server's connector writes to (its shared_storage_path), as seen on this machine"
            )
        time.sleep(0.05)
    if lock.is_file():
        with lock.open() as handle:
            fcntl.flock(handle, fcntl.LOCK_SH)
            tensors = load_file(str(path), device="cpu")
        lock.unlink()
    else:
        tensors = _read_unlocked(path, deadline)
    path.unlink()
    return tensors


def reply_file_taker(folder: Path) -> Callable[[Any], None]:
    """For a client that reads only the server's replies (the serving-reference recording): each
    reply's hidden-state file (in ``folder``, as seen here) taken once written, so none is left behind;
    :class:`ServingReferenceError` when it does not appear."""
    from eagle3_pipeline.training_data.serving_reference import ServingReferenceError

    def take(payload: Any) -> None:
        written = payload.get("kv_transfer_params") if isinstance(payload, dict) else None
        if isinstance(written, dict) and written.get("hidden_states_path"):
            try:
                take_file(folder / Path(str(written["hidden_states_path"])).name)
            except VllmError as exc:
                raise ServingReferenceError(str(exc)) from None

    return take


def _read_unlocked(path: Path, deadline: float) -> dict[str, Any]:
    """A file of a connector without the lock (older vLLM writes it in place): retried until it parses."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    while True:
        try:
            return load_file(str(path), device="cpu")
        except (SafetensorError, OSError) as exc:
            if time.monotonic() > deadline:
                raise VllmError(
                    f"{DIR_SETTING} {str(path.parent)!r}: {path.name} is still unreadable "
                    f"after {FILE_WAIT_S:.0f} s ({exc})"
                ) from None
            time.sleep(0.05)


def served_model(http: Any, base_url: str) -> str:
    """The one model name the server at ``base_url`` (…/v1) serves: what requests to it must name."""
    import httpx

    try:
        reply = http.get(f"{base_url}/models")
        reply.raise_for_status()
        models = [str(m["id"]) for m in reply.json()["data"]]
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
        raise VllmError(
            f"{URL_SETTING} {base_url!r}: GET /models failed ({type(exc).__name__}: {exc}); expected a "
            "running vLLM server's …/v1 URL"
        ) from None
    if len(models) != 1:
        raise VllmError(
            f"{URL_SETTING} {base_url!r}: the server serves {models}; expected exactly one model (the target)"
        )
    return models[0]


@contextmanager
def open_vllm_target(model: str, name: str, base_url: str, output_dir: str, parallel: int) -> Iterator[VllmTarget]:
    """The server at ``base_url`` as a state source; ``model``: the target's checkpoint folder here."""
    import httpx

    identity = target_identity(model, name)
    raw = read_config(model)
    eps = text_config(raw).get("rms_norm_eps")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise VllmError(
            f"hidden_states.model {model!r}: the language model's config has no rms_norm_eps; "
            "expected the final RMSNorm's epsilon"
        )
    norm_name = drafter_tensor_names(Path(model)).norm
    norm = read_tensors(Path(model), [norm_name])[norm_name]
    folder = Path(output_dir)
    if not folder.is_dir():
        raise VllmError(
            f"{DIR_SETTING} {output_dir!r}: not a folder here; expected the connector's "
            "shared_storage_path as seen on this machine"
        )
    url = extraction_url(base_url.rstrip("/"))
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        served = served_model(http, url)
        yield VllmTarget(
            http,
            url,
            served=served,
            output_dir=folder,
            identity=identity,
            family=target_family(raw),
            norm_name=norm_name,
            norm=norm,
            eps=float(eps),
            parallel=parallel,
        )
