"""The tunnels a pipeline's servers need: a managed server (or a benchmark arm's) listens on its SSH host's
loopback, so this process declares a route for its URL (:data:`eagle3_pipeline.hosts.TUNNELS`), and every
client here reaches it through one SSH forward (:mod:`eagle3_pipeline.hosts.tunnel`).

Declared where a process reads the pipeline file for work — the pipeline resource (every asset, check and
sensor), the CLI — and closed where that work ends (the resource's teardown, the command's exit).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from eagle3_pipeline.config import HostConfig, PipelineConfig
from eagle3_pipeline.config.serving import is_loopback
from eagle3_pipeline.hosts import TUNNELS, SshHost, build_host
from eagle3_pipeline.managed.servers import managed_servers


def declare_route(url: str, host: HostConfig, port: int) -> bool:
    """A route for a server on ``host``'s loopback at ``port`` that this process knows by ``url``; False (none
    declared) when ``host`` is this machine or ``url`` names a loopback here (the user's own forward)."""
    if host.kind != "ssh" or is_loopback(urlsplit(url).hostname or ""):
        return False
    ssh = build_host(host)
    assert isinstance(ssh, SshHost)  # kind ssh
    TUNNELS.declare(url, ssh, port)
    return True


def declare_tunnels(config: PipelineConfig) -> list[str]:
    """Routes for the pipeline's managed servers that listen on an SSH host's loopback; their URLs."""
    return [
        setup.base_url
        for setup in managed_servers(config)
        if setup.tunnelled and declare_route(setup.base_url, setup.host, setup.port)
    ]
