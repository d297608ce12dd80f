"""Notifications: a message with the report, POSTed to a webhook when something changes for the worse.

Events: the health gate's verdict turns CRITICAL or UNKNOWN, a stall is detected, a dataset's token
budget is reached, τ regresses (drafter_eval's check fails), a managed server could not be brought back
after dying mid-generation (its restarts spent). Each event has a *subject* (e.g.
``health``, ``budget:B1``) and a *state*; a message goes out only when the subject's state changes to
an alerting one, so a host that stays CRITICAL for an hour sends one message, and a host that
recovers and fails again sends a second. The last state of each subject is a small JSON file under
``<artifacts_root>/alerts/`` (one file per subject, written atomically), shared by every process
that raises alerts.

The webhook URL is a secret (Slack's carries a token): the pipeline file names the environment
variable holding it (`alerts.webhook_url_env`), and an unset variable turns alerts off with a
one-line warning. Before sending, every secret value the pipeline file points at (API keys, SSH key
passphrases, the webhook URL) is masked in the message; errors name the variable, never the URL.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from eagle3_pipeline.config import AlertsConfig, PipelineConfig
from eagle3_pipeline.health import HealthReport
from eagle3_pipeline.health.report import report_markdown

MASK = "[redacted]"
MAX_REPORT_CHARS = 3500  # Slack cuts a section at 3000 characters of text; keep messages readable everywhere


@dataclass(frozen=True)
class Alert:
    kind: str  # health | stall | budget | tau_regression | server_lost
    subject: str
    state: str
    title: str
    report: str


def secret_variables(config: PipelineConfig) -> list[str]:
    """Every environment variable the pipeline file names as holding a secret."""
    names = [e.api_key_env for e in config.inference.all_endpoints]
    names += [
        config.health.host.key_passphrase_env,
        config.compute.host.key_passphrase_env,
        config.alerts.webhook_url_env,
    ]
    return [n for n in names if n]


def secret_values(variables: Iterable[str]) -> list[str]:
    """The variables' values as they are now, longest first (so a secret inside another is masked whole)."""
    values = [os.environ.get(n) or "" for n in variables]
    return sorted({v for v in values if len(v) >= 4}, key=len, reverse=True)


def redact(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, MASK)
    return text


def message_body(pipeline: str, settings: AlertsConfig, alert: Alert) -> dict[str, object]:
    report = alert.report if len(alert.report) <= MAX_REPORT_CHARS else alert.report[:MAX_REPORT_CHARS] + "\n…"
    headline = f"[eagle3 {pipeline}] {alert.title}"
    if settings.format == "slack":
        return {"text": f"*{headline}*\n```\n{report}\n```"}
    return {
        "pipeline": pipeline,
        "kind": alert.kind,
        "subject": alert.subject,
        "state": alert.state,
        "title": headline,
        "report": report,
    }


class AlertLedger:
    """The last state of each subject, one small file each (so parallel runs never race on one file)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, subject: str) -> Path:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", subject)[:60]
        return self.folder / f"{safe}.{hashlib.sha256(subject.encode()).hexdigest()[:12]}.json"

    def last(self, subject: str) -> str | None:
        try:
            return str(json.loads(self._path(subject).read_text())["state"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None

    def record(self, subject: str, state: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self._path(subject)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"subject": subject, "state": state}))
        tmp.replace(path)


class Alerter:
    """Sends the alerts of one pipeline (its name and `alerts` section); the last states live in `ledger`,
    the values of `secret_variables` are masked in every message, `host` names the health gate's host, and
    `warn` receives one line when an alert is not delivered."""

    def __init__(
        self,
        pipeline: str,
        settings: AlertsConfig,
        ledger: AlertLedger,
        secret_variables: Sequence[str],
        host: str,
        warn: Callable[[str], None],
    ) -> None:
        self.pipeline = pipeline
        self.settings = settings
        self.ledger = ledger
        self.secret_variables = list(secret_variables)
        self.host = host
        self.warn = warn

    @classmethod
    def for_pipeline(cls, config: PipelineConfig, warn: Callable[[str], None]) -> Alerter:
        """The alerts of a pipeline file: its ledger under ``<artifacts_root>/alerts``, every secret it names."""
        ledger = AlertLedger(Path(config.artifacts_root) / "alerts")
        host = config.health.host.hostname or "localhost"
        return cls(config.name, config.alerts, ledger, secret_variables(config), host, warn)

    @property
    def configured(self) -> bool:
        return self.settings.webhook_url_env is not None

    def observe(self, subject: str, state: str, alerting: bool, make_alert: Callable[[], Alert]) -> bool:
        """Record `state` for `subject`; if it changed and `alerting`, send the alert. True if sent."""
        if not self.configured or self.ledger.last(subject) == state:
            return False
        self.ledger.record(subject, state)
        return alerting and self.send(make_alert())

    def send(self, alert: Alert) -> bool:
        settings = self.settings
        var = settings.webhook_url_env
        url = os.environ.get(var or "")
        if not url:
            self.warn(f"alert not sent ({alert.title}): alerts are off because environment variable {var} is not set")
            return False
        secrets = [json.dumps(s)[1:-1] for s in secret_values(self.secret_variables)]
        body = json.loads(redact(json.dumps(message_body(self.pipeline, settings, alert)), secrets))
        try:
            response = httpx.post(url, json=body, timeout=settings.timeout_s)
        except httpx.HTTPError as exc:
            self.warn(f"alert not sent ({alert.title}): webhook from {var} unreachable ({exc.__class__.__name__})")
            return False
        if response.status_code >= 300:
            self.warn(f"alert not sent ({alert.title}): webhook from {var} answered HTTP {response.status_code}")
            return False
        return True


# The events, as the Dagster layer reports them.

HEALTH_ALERTING = ("critical", "unknown")


def health_changed(alerter: Alerter, report: HealthReport, name: str | None = None, stopped: str | None = None) -> bool:
    """The gate's verdict on the inference host (the scheduled backfill and `inference_health` both call this);
    `name`: which of several inference hosts (default: the health section's host name). `stopped`: the
    host's managed server is stopped and the run that needs it starts it (why), recorded as the state
    ``stopped``, which does not alert: the pipeline stopped it, or will restart it."""
    host = name or alerter.host
    overall = "stopped" if stopped is not None else report.overall.value
    return alerter.observe(
        f"health:{host}",
        overall,
        overall in HEALTH_ALERTING,
        lambda: Alert(
            "health",
            f"health:{host}",
            overall,
            f"health gate {overall.upper()} on {host}: {report.summary()}",
            report_markdown(report),
        ),
    )


def server_lost(alerter: Alerter, server: str, run_id: str, message: str) -> bool:
    """A run's managed server died or hung and could not be brought back: `message` names its restarts and
    its log's tail. One alert per run."""
    subject = f"server_lost:{server}:{run_id}"
    return alerter.observe(
        subject,
        "lost",
        True,
        lambda: Alert("server_lost", subject, "lost", f"managed server {server} lost (run {run_id[:8]})", message),
    )


def stall_detected(alerter: Alerter, what: str, run_id: str, detail: str) -> bool:
    subject = f"stall:{what}:{run_id}"
    return alerter.observe(
        subject, "stalled", True, lambda: Alert("stall", subject, "stalled", f"stall: {detail}", detail)
    )


BUDGET_FIELDS = (
    "token_budget",
    "budget_counts",
    "budget_tokens",
    "budget_overshoot",
    "rows",
    "prompts",
    "skipped_by_budget",
    "held_back_by_budget",
    "completion_tokens",
    "cost_total",
)


def budget_reached(alerter: Alerter, dataset: str, metadata: Mapping[str, Any]) -> bool:
    """After a `responses` materialization: its metadata (`budget_reached` and the counts)."""
    reached = bool(metadata.get("budget_reached"))
    state = "reached" if reached else "within"
    report = "\n".join(f"{key}: {metadata[key]}" for key in BUDGET_FIELDS if key in metadata)
    return alerter.observe(
        f"budget:{dataset}",
        state,
        reached,
        lambda: Alert("budget", f"budget:{dataset}", state, f"token budget reached for {dataset}", report),
    )


def tau_checked(alerter: Alerter, passed: bool, verdict: str) -> bool:
    state = "passed" if passed else "regressed"
    return alerter.observe(
        "tau_regression",
        state,
        not passed,
        lambda: Alert("tau_regression", "tau_regression", state, "drafter τ regressed", verdict),
    )
