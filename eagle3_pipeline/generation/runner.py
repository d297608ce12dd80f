"""The generation engine: answer every prompt not yet in the checkpoint.

One dispatcher sends the prompts in a single id-ordered stream — ids are content hashes, so
wherever a budget stop lands, the answered prompts are an unbiased sample of the dataset, long and
short alike. Before each prompt leaves it waits for a free slot of its length class
(``concurrency.short`` / ``concurrency.long``) and for the token budget's admission; a prompt never
overtakes an earlier one. Each request goes to the least busy endpoint, transient failures (and
empty answers) are retried with backoff, and each answer is appended to the checkpoint the moment
it arrives. Requests in flight reuse small HTTP clients that keep one connection alive per
endpoint: a single shared pool of 150+ connections scans all of them on every request and spends
more CPU on that than on the requests. A request that fails for good goes to the errors file;
``max_consecutive_errors`` of them in a row stop the run, and so does an answer from another model
than the dataset's answers so far (it is not written). With ``generation.failover`` the requests go
to one backend at a time and a watcher moves the dataset on (see :mod:`.failover`): the requests in
flight on the old backend are cancelled and each is sent again, once, to the new one. With a
``recovery`` hook (a managed server), a request that fails the way a dead or hung server fails waits
for one shared recovery; when it restarted the server, the failed requests and those in flight on the
old server are sent again without counting as retries or errors (see :mod:`.recovery`), one at a time, and
a prompt in flight at two crashes is quarantined (see :mod:`.quarantine`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import httpx

from eagle3_pipeline.config import GenerationConfig
from eagle3_pipeline.generation.budget import TokenBudget, counted_tokens
from eagle3_pipeline.generation.checkpoint import CheckpointWriter, ErrorLog, ResponseCheckpoint
from eagle3_pipeline.generation.client import AttemptFailure, Completion, attempt_completion, request_body
from eagle3_pipeline.generation.conversation import build_record, generated_message, turns_to_regenerate
from eagle3_pipeline.generation.endpoints import Endpoint, EndpointPool
from eagle3_pipeline.generation.estimate import Workload, estimate_left
from eagle3_pipeline.generation.failover import Failover, FailoverSettings
from eagle3_pipeline.generation.outcome import GenerationFailed, GenerationSummary, ModelChanged, ServerLost
from eagle3_pipeline.generation.progress import Progress, ProgressSink, eta_s
from eagle3_pipeline.generation.prompts import estimate_tokens
from eagle3_pipeline.generation.quarantine import QUARANTINED_KIND, Quarantine, Quarantined, quarantined_ids
from eagle3_pipeline.generation.recovery import Recovered, RecoveryFailed, ServerRecovery, SharedRecovery
from eagle3_pipeline.generation.retry import backoff_s
from eagle3_pipeline.records import Message, PromptRecord, normalized

ERROR_EXAMPLES = 5
P = ParamSpec("P")
T = TypeVar("T")
SERIES_POINTS = 500


class RequestFailed(Exception):
    def __init__(self, failure: AttemptFailure, attempts: int, endpoint: Endpoint) -> None:
        super().__init__(failure.reason)
        self.failure = failure
        self.attempts = attempts
        self.endpoint = endpoint


def served_model(records: Iterable[Mapping[str, Any]]) -> str | None:
    """The model (as the server named it) of a dataset's finished answers; the first one wins."""
    return next((str(r["model"]) for r in records if r.get("model")), None)


def pending(prompts: Sequence[PromptRecord], done: dict[str, Any]) -> list[PromptRecord]:
    """Prompts without a finished answer, each id once, in id order."""
    unique = {p.id: p for p in prompts if p.id not in done}
    return [unique[key] for key in sorted(unique)]


class _Run:
    def __init__(
        self,
        settings: GenerationConfig,
        new_client: Callable[[], httpx.AsyncClient],
        *,
        pool: EndpointPool,
        budget: TokenBudget,
        writer: CheckpointWriter,
        errors: ErrorLog,
        summary: GenerationSummary,
        sinks: Sequence[ProgressSink],
        model: str | None,
        failover: Failover | None = None,
        finished: Sequence[Mapping[str, Any]] = (),
        recovery: ServerRecovery | None = None,
    ) -> None:
        self.settings = settings
        self.failover = failover
        self.recovery = (
            SharedRecovery(recovery, summary.restarts.extend, self._restarted) if recovery is not None else None
        )
        self.quarantine = Quarantine() if recovery is not None else None
        self.sent: dict[asyncio.Task[Any], tuple[str, float]] = {}  # attempt → (prompt id, when it was sent)
        self.awaiting: dict[str, float] = {}  # prompt id → when its failed attempt was sent, while it awaits a verdict
        self.finished = (
            len(finished),
            sum(int(r.get("completion_tokens") or 0) for r in finished),
            sum(int(r.get("prompt_tokens") or 0) for r in finished),
        )
        self.attempts: dict[asyncio.Task[Any], Endpoint] = {}
        self.prompt_tokens_est = 0.0
        self.model = model
        self.new_client = new_client
        self.pool = pool
        self.budget = budget
        self.writer = writer
        self.errors = errors
        self.summary = summary
        self.sinks = [*sinks, ProgressSink(settings.progress_interval_s, self._sample)]
        self.rng = random.Random()
        self.consecutive_failures = 0
        self.stopping = False
        self.started = time.monotonic()
        self.remaining = 0

    async def execute(self, todo: Sequence[PromptRecord]) -> None:
        slots = {
            "short": asyncio.Semaphore(self.settings.concurrency.short),
            "long": asyncio.Semaphore(self.settings.concurrency.long),
        }
        idle: list[httpx.AsyncClient] = []
        self.remaining = len(todo)
        self.prompt_tokens_est = sum(p.prompt_tokens_est for p in todo) / len(todo) if todo else 0.0
        dispatched = 0
        ticker = asyncio.create_task(self._tick())
        watcher = asyncio.create_task(self._watch()) if self.failover else None
        try:
            async with contextlib.AsyncExitStack() as clients, asyncio.TaskGroup() as group:
                for prompt in todo:
                    slot = slots[prompt.length_class]
                    await slot.acquire()
                    if self.stopping or not await self.budget.admit():
                        slot.release()
                        break
                    client = idle.pop() if idle else await clients.enter_async_context(self.new_client())
                    dispatched += 1
                    group.create_task(self._request(prompt, slot, client, idle))
        except ExceptionGroup as caught:
            raise caught.exceptions[0] from None
        finally:
            ticker.cancel()
            if watcher is not None:
                watcher.cancel()
            self.summary.skipped_by_budget = len(todo) - dispatched if self.budget.exhausted else 0
            self.summary.elapsed_s = time.monotonic() - self.started
            self.summary.endpoints = self.pool.stats()
            snapshot = self._snapshot()
            for sink in self.sinks:
                sink.emit(snapshot)

    async def _request(
        self, prompt: PromptRecord, slot: asyncio.Semaphore, client: httpx.AsyncClient, idle: list[httpx.AsyncClient]
    ) -> None:
        tokens: int | None = None
        try:
            record = await self._answer(client, prompt)
            tokens = counted_tokens(record, self.settings.budget_counts)
            self._succeeded(record)
        except RequestFailed as failed:
            self._failed(prompt, failed)
        except Quarantined as quarantined:
            self._quarantined(prompt, str(quarantined))
        finally:
            if self.quarantine is not None:
                await self.quarantine.finished(prompt.id)
            idle.append(client)
            slot.release()
            self.remaining -= 1
            self.budget.settle(tokens)

    async def _answer(self, client: httpx.AsyncClient, prompt: PromptRecord) -> dict[str, Any]:
        history = [normalized(m) for m in prompt.messages]
        tools = prompt.tool_schemas()
        keep = self.settings.reasoning == "keep"
        turns: list[tuple[int, Completion]] = []
        for index in [*turns_to_regenerate(history, self.settings.regenerate_turns), len(history)]:
            turn = await self._complete(client, prompt.id, history[:index], tools, prompt.tools)
            self._same_model(prompt, turn)
            history[index : index + 1] = [generated_message(turn, keep)]
            turns.append((index, turn))
        return build_record(prompt, turns, keep)

    def _same_model(self, prompt: PromptRecord, turn: Completion) -> None:
        """The first answer fixes the dataset's model; an answer from another one stops the run."""
        if self.model is None:
            self.model = turn.model
        elif turn.model != self.model and not self.stopping:
            self.stopping = True
            raise ModelChanged(
                f"{prompt.dataset}: {turn.endpoint} answered as model {turn.model!r}, but the dataset's answers come "
                f"from {self.model!r}; that answer was not written and the run stopped. Point every endpoint at the "
                "same model, or regenerate the dataset under a new fingerprint.",
                self.summary,
            )

    async def _complete(
        self,
        client: httpx.AsyncClient,
        prompt_id: str,
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        tools_text: str | None,
    ) -> Completion:
        settings = self.settings
        prompt_tokens_est = estimate_tokens(messages, tools_text)
        avoid: Endpoint | None = None
        attempt = 0
        while True:
            if self.recovery is not None:
                await self._server_back()
            if self.quarantine is not None:
                await self.quarantine.turn(prompt_id)
            attempt += 1
            endpoint = self.pool.acquire(avoid)
            body = request_body(
                endpoint, messages, tools, settings.max_tokens, settings.temperature, settings.chat_template_kwargs
            )
            sent_at = time.monotonic()
            attempt_task = asyncio.create_task(attempt_completion(client, endpoint, body, prompt_tokens_est))
            self.attempts[attempt_task] = endpoint
            self.sent[attempt_task] = (prompt_id, sent_at)
            try:
                await asyncio.wait({attempt_task})
            except BaseException:
                attempt_task.cancel()
                self.pool.release(endpoint, ok=False)
                raise
            finally:
                del self.attempts[attempt_task], self.sent[attempt_task]
            try:  # in flight for the quarantine's gate until a failure is judged: nothing slips in before a recovery
                if attempt_task.cancelled():  # moved to another backend, or its server restarted: send it again, once
                    self.pool.release(endpoint, ok=True)
                    attempt, avoid = attempt - 1, None
                    continue
                outcome = attempt_task.result()
                self.pool.release(endpoint, ok=isinstance(outcome, Completion))
                if isinstance(outcome, Completion):
                    if self.failover:
                        self.failover.answered(endpoint, outcome.completion_tokens)
                    return outcome
                if await self._restarted_for(endpoint, outcome, prompt_id, sent_at):  # failed on the old server
                    self.summary.resent_after_restart += 1
                    attempt, avoid = attempt - 1, None
                    continue
            finally:
                if self.quarantine is not None:
                    await self.quarantine.sent(prompt_id)
            if (
                self.failover
                and outcome.retryable
                and outcome.kind != "empty"
                and self.failover.attempt_failed(endpoint)
            ):
                self._move(
                    f"unhealthy: {self.failover.failed_in_a_row} failed attempts in a row "
                    f"(last: {self.pool.redact(outcome.reason)})"
                )
            if self.failover and endpoint is not self.failover.current:  # failed on a backend the dataset has left
                attempt, avoid = attempt - 1, None
                continue
            if not outcome.retryable or attempt >= settings.retry.max_attempts:
                raise RequestFailed(outcome, attempt, endpoint)
            self.summary.retries += 1
            avoid = endpoint
            await asyncio.sleep(backoff_s(attempt, settings.retry, outcome.retry_after_s, self.rng))

    async def _server_back(self) -> None:
        """Wait while a recovery runs; its failure stops the run (:class:`ServerLost`)."""
        assert self.recovery is not None
        try:
            await self.recovery.ready()
        except RecoveryFailed as exc:
            raise self._lost(exc) from None

    async def _restarted_for(self, endpoint: Endpoint, outcome: AttemptFailure, prompt_id: str, sent_at: float) -> bool:
        """Whether ``outcome`` is a dead or hung server's failure that a recovery answered by restarting it
        (:mod:`.recovery`); False for any other failure, and when the server was found serving."""
        recovery = self.recovery
        if recovery is None or not recovery.covers(endpoint.base_url, outcome.kind):
            return False
        self.awaiting[prompt_id] = sent_at
        try:
            verdict = await recovery.after_failure(self.pool.redact(outcome.reason), sent_at)
        except RecoveryFailed as exc:
            raise self._lost(exc) from None
        finally:
            self.awaiting.pop(prompt_id, None)
        return verdict.restarted

    def _restarted(self, started: float, verdict: Recovered) -> None:
        """A recovery that started at ``started`` restarted the server: the prompts in flight on the old one
        (sent before it started) are suspects or quarantined (:mod:`.quarantine`), and the attempts still in
        flight are cancelled (each is sent again by its request)."""
        assert self.recovery is not None and self.quarantine is not None
        hook = self.recovery.hook
        crashed = {p for p, sent_at in self.awaiting.items() if sent_at < started}
        for task, endpoint in self.attempts.items():
            if hook.serves(endpoint.base_url) and not task.done():
                prompt_id, sent_at = self.sent[task]
                if sent_at < started:
                    crashed.add(prompt_id)
                task.cancel()
                self.summary.resent_after_restart += 1
        why = verdict.restarts[-1]["reason"] if verdict.restarts else verdict.detail
        self.quarantine.crashed(crashed, len(self.summary.restarts), why)

    def _lost(self, exc: RecoveryFailed) -> ServerLost:
        self.stopping = True
        summary = self.summary
        return ServerLost(
            f"{summary.dataset}: {exc}\nThe {summary.generated} answers of this run are checkpointed and a rerun "
            "resumes from them.",
            summary,
        )

    def _left(self) -> Workload:
        """What is left of the dataset as this run stands: the prompts not yet ended, the mean
        tokens per answer of every answer so far, the budget left."""
        summary, settings = self.summary, self.settings
        answers, completion, prompt = self.finished
        budget_left = self.budget.budget - self.budget.counted if self.budget.budget is not None else None
        return estimate_left(
            summary.dataset,
            pending=self.remaining,
            answers=answers + summary.generated,
            completion_done=completion + summary.completion_tokens,
            prompt_done=prompt + summary.prompt_tokens,
            budget_left=budget_left,
            counts=settings.budget_counts,
            bound_per_prompt=settings.max_tokens,
            prompt_per_prompt=self.prompt_tokens_est,
        )

    def _move(self, reason: str) -> None:
        """Make the next failover backend current: cancel the attempts in flight on the old one (each
        is sent again by its request), record the decision with the numbers (the old backend's rate
        since it became current, the tokens left, the ETA there), and send everything to the new one."""
        failover = self.failover
        assert failover is not None
        old, left, rate = failover.current, self._left(), failover.rate()
        eta = left.completion_left / rate if rate and left.completion_left is not None else None
        in_flight = [task for task, endpoint in self.attempts.items() if endpoint is old and not task.done()]
        for task in in_flight:
            task.cancel()
        sent = next(s["requests"] for s in self.pool.stats() if s["endpoint"] == old.base_url)
        decision = failover.move(reason, left, rate, eta, sent, len(in_flight))
        self.pool.use_only(failover.current)
        self.summary.failovers.append(decision)
        self.summary.moved_in_flight += len(in_flight)

    async def _watch(self) -> None:
        """Every ``check_every_s``: move on when the ETA on the current backend passes the deadline;
        probe the current backend when it delivered nothing while requests were in flight."""
        failover = self.failover
        assert failover is not None
        while True:
            await asyncio.sleep(failover.settings.check_every_s)
            if failover.past_deadline(self._left()):
                self._move("deadline: the ETA on this backend passes the deadline")
                continue
            endpoint = failover.current
            waiting = any(e is endpoint and not t.done() for t, e in self.attempts.items())
            if (
                failover.silent_since_last_check()
                and waiting
                and failover.settings.probe_timeout_s
                and failover.has_next
            ):
                failure = await self._probe(endpoint, failover.settings.probe_timeout_s)
                if failure is not None and failover.attempt_failed(endpoint):
                    self._move(
                        f"unhealthy: {failover.failed_in_a_row} failed attempts in a row "
                        f"(last: probe: {self.pool.redact(failure)})"
                    )

    async def _probe(self, endpoint: Endpoint, timeout_s: float) -> str | None:
        """A 1-token request to ``endpoint``: None if it answered within ``timeout_s``, else why not."""
        body = request_body(endpoint, [normalized({"role": "user", "content": "ping"})], None, 1, 0.0)
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            outcome = await attempt_completion(client, endpoint, body, 1)
        if isinstance(outcome, Completion) or outcome.kind == "empty":
            return None
        return outcome.reason

    def _succeeded(self, record: dict[str, Any]) -> None:
        self.writer.append(record)
        summary = self.summary
        summary.generated += 1
        summary.completion_tokens += record["completion_tokens"]
        summary.prompt_tokens += record["prompt_tokens"]
        summary.counted_now += counted_tokens(record, self.settings.budget_counts)
        summary.cost += record["cost"] or 0.0
        summary.truncated += record["finish_reason"] == "length"
        summary.usage_estimated += bool(record.get("usage_estimated"))
        self.consecutive_failures = 0

    def _quarantined(self, prompt: PromptRecord, reason: str) -> None:
        """A quarantined prompt: failed, in the errors file as such (the next run leaves it out)."""
        entry = {"id": prompt.id, "dataset": prompt.dataset, "reason": reason, "kind": QUARANTINED_KIND}
        self.errors.append({**entry, "quarantined": True, "retryable": False, "at": time.time()})
        self.summary.failed += 1
        self.summary.quarantined += 1
        if len(self.summary.error_examples) < ERROR_EXAMPLES:
            self.summary.error_examples.append(f"{prompt.id}: {reason}")

    def _failed(self, prompt: PromptRecord, failed: RequestFailed) -> None:
        reason = self.pool.redact(str(failed))
        self.errors.append(
            {
                "id": prompt.id,
                "dataset": prompt.dataset,
                "reason": reason,
                "status": failed.failure.status,
                "attempts": failed.attempts,
                "retryable": failed.failure.retryable,
                "kind": failed.failure.kind,
                "endpoint": failed.endpoint.base_url,
                "at": time.time(),
            }
        )
        summary = self.summary
        summary.failed += 1
        summary.empty += failed.failure.kind == "empty"
        if len(summary.error_examples) < ERROR_EXAMPLES:
            summary.error_examples.append(f"{prompt.id}: {reason} (attempts: {failed.attempts})")
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.settings.max_consecutive_errors and not self.stopping:
            self.stopping = True
            raise GenerationFailed(
                f"{prompt.dataset}: stopped after {self.consecutive_failures} requests in a row failed "
                f"(last: {reason}; attempts: {failed.attempts}). The server is probably down or "
                f"refusing requests; the {summary.generated} answers of this run are checkpointed and a "
                f"rerun resumes from them.",
                summary,
            )

    def _snapshot(self) -> Progress:
        summary = self.summary
        elapsed = time.monotonic() - self.started
        budget_left = summary.token_budget - self.budget.counted if summary.token_budget is not None else None
        rate = summary.generated / elapsed if elapsed > 0 else 0.0
        token_rate = summary.counted_now / elapsed if elapsed > 0 else 0.0
        return Progress(
            dataset=summary.dataset,
            done=summary.already_done + summary.generated,
            total=summary.total,
            generated=summary.generated,
            failed=summary.failed,
            retries=summary.retries,
            truncated=summary.truncated,
            completion_tokens=summary.completion_tokens,
            budget_tokens=self.budget.counted,
            token_budget=summary.token_budget,
            elapsed_s=elapsed,
            eta_s=eta_s(self.remaining, rate, budget_left, token_rate),
        )

    def _sample(self, progress: Progress) -> None:
        """One point of the throughput series: rates over the interval since the previous point."""
        series = self.summary.series
        before = (
            series[-1]
            if series
            else {"elapsed_s": 0.0, "done": float(progress.done - progress.generated), "completion_tokens": 0.0}
        )
        span = progress.elapsed_s - before["elapsed_s"]
        if span <= 0:
            return
        series.append(
            {
                "elapsed_s": round(progress.elapsed_s, 2),
                "done": float(progress.done),
                "completion_tokens": float(progress.completion_tokens),
                "tokens_per_s": round((progress.completion_tokens - before["completion_tokens"]) / span, 2),
                "requests_per_s": round((progress.done - before["done"]) / span, 3),
            }
        )
        if len(series) > SERIES_POINTS:
            del series[1:-1:2]

    async def _tick(self) -> None:
        due = [sink.every_s for sink in self.sinks]
        while True:
            await asyncio.sleep(max(0.0, min(due) - (time.monotonic() - self.started)))
            snapshot = self._snapshot()
            for index, sink in enumerate(self.sinks):
                if snapshot.elapsed_s >= due[index]:
                    sink.emit(snapshot)
                    due[index] = snapshot.elapsed_s + sink.every_s


async def generate_async(
    prompts: Sequence[PromptRecord],
    resolve_endpoints: Callable[[], Sequence[Endpoint]],
    *,
    settings: GenerationConfig,
    checkpoint: ResponseCheckpoint,
    errors_path: Path,
    token_budget: int | None = None,
    sinks: Sequence[ProgressSink] = (),
    failover: FailoverSettings | None = None,
    recovery: ServerRecovery | None = None,
) -> GenerationSummary:
    """Answer every prompt not yet in the checkpoint, appending each answer as it finishes.

    ``resolve_endpoints`` is called only if there is work left and budget to do it, so a finished
    dataset never starts or contacts a server. ``recovery`` brings a dead or hung server back
    mid-run (:mod:`.recovery`). Raises :class:`GenerationFailed` when ``max_consecutive_errors``
    requests fail in a row, and :class:`ServerLost` when the recovery cannot bring the server back."""
    dataset = prompts[0].dataset if prompts else ""
    summary = GenerationSummary(dataset=dataset, total=len(prompts), token_budget=token_budget)
    with checkpoint.writer() as writer:
        ids = {p.id for p in prompts}
        finished = [record for key, record in writer.done.items() if key in ids]
        todo = pending(prompts, writer.done)
        summary.already_done = len(prompts) - len(todo)
        earlier = quarantined_ids(errors_path)
        summary.quarantined_earlier = sum(p.id in earlier for p in todo)
        todo = [p for p in todo if p.id not in earlier]
        counted = sum(counted_tokens(r, settings.budget_counts) for r in finished)
        budget = TokenBudget(token_budget, counted, len(finished), _first_guess(todo, settings))
        if not todo:
            return summary
        if budget.exhausted:
            summary.skipped_by_budget = len(todo)
            return summary
        endpoints = list(resolve_endpoints())
        switcher = Failover(failover, endpoints) if failover else None
        pool = EndpointPool(switcher.endpoints if switcher else endpoints)
        if switcher:
            pool.use_only(switcher.current)
        new_client = _client_factory(settings, len(endpoints))
        errors = ErrorLog(errors_path)
        try:
            run = _Run(
                settings,
                new_client,
                pool=pool,
                budget=budget,
                writer=writer,
                errors=errors,
                summary=summary,
                sinks=sinks,
                model=served_model(writer.done.values()),
                failover=switcher,
                finished=finished,
                recovery=recovery,
            )
            await run.execute(todo)
        finally:
            errors.close()
    return summary


def _client_factory(settings: GenerationConfig, endpoints: int) -> Callable[[], httpx.AsyncClient]:
    """Per-worker HTTP clients: one keep-alive connection per endpoint, a shared TLS context."""
    timeout = httpx.Timeout(
        connect=settings.connect_timeout_s, read=settings.read_timeout_s, write=settings.read_timeout_s, pool=None
    )
    limits = httpx.Limits(max_connections=endpoints, max_keepalive_connections=endpoints)
    tls = httpx.create_ssl_context()
    return lambda: httpx.AsyncClient(verify=tls, timeout=timeout, limits=limits)


def _first_guess(todo: Sequence[PromptRecord], settings: GenerationConfig) -> int:
    """What a request is expected to count before any has finished: its most, on average."""
    if not todo:
        return settings.max_tokens
    turns = sum(1 + len(turns_to_regenerate(p.messages, settings.regenerate_turns)) for p in todo) / len(todo)
    guess = settings.max_tokens * turns
    if settings.budget_counts == "prompt_and_completion":
        guess += sum(p.prompt_tokens_est for p in todo) / len(todo)
    return max(1, round(guess))


def _run_to_completion(coroutine: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, T]:
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        return asyncio.run(coroutine(*args, **kwargs))

    return functools.wraps(coroutine)(run)


# generate_async in an event loop of its own, for callers that are not async (the generation phase, tests).
generate = _run_to_completion(generate_async)
