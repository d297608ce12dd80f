"""Resources: the inference endpoint (embedded server started for the run, or a remote one)."""

from __future__ import annotations

import dagster as dg
from pydantic import PrivateAttr

from eagle3_pipeline.config import load_config
from eagle3_pipeline.defs.launching import HOST_TAG
from eagle3_pipeline.generation import Endpoint
from eagle3_pipeline.health import HealthReport
from eagle3_pipeline.serving import InferenceProvider


def run_host(run: dg.DagsterRun | None) -> str | None:
    """The inference host a run was placed on (tag `eagle3/host`), or None."""
    return run.tags.get(HOST_TAG) if run is not None else None


class InferenceResource(dg.ConfigurableResource):
    """Where `responses` sends requests. Leave `base_url` empty to use the pipeline file's
    inference section (the embedded server is then started on first use and stopped after the
    run); set it to point one run at an already running OpenAI-compatible server. API keys are read
    from the variables the file names when the endpoints are first used, so a missing key fails the
    run that needs it, never the code location's load.

    With several inference hosts (`inference.hosts`), a run uses the host its tag `eagle3/host`
    names — its endpoints and its health section for the preflight — and a run without the tag
    the first host listed."""

    config_path: str
    base_url: str | None = None
    model: str | None = None
    _provider: InferenceProvider | None = PrivateAttr(default=None)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        config = load_config(self.config_path, runtime_checks=False).for_host(run_host(context.run))
        override = Endpoint(self.base_url, self.model or config.target.model) if self.base_url else None
        self._provider = InferenceProvider(config, override)

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._provider is not None:
            self._provider.close()

    def _require(self) -> InferenceProvider:
        if self._provider is None:
            raise RuntimeError("InferenceResource used outside a run")
        return self._provider

    def endpoints(self) -> list[Endpoint]:
        return self._require().endpoints()

    @property
    def preflight_report(self) -> HealthReport | None:
        return self._require().preflight_report

    def tokenizer_name(self) -> str:
        return self._require().tokenizer_name()
