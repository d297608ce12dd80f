"""What the commands share: the pipeline file, loaded with its error printed, and the Dagster home."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from importlib import resources
from pathlib import Path

from eagle3_pipeline.config import ConfigError, PipelineConfig, load_config

DEFAULT_DAGSTER_HOME = ".dagster_home"


def ensure_dagster_home() -> Path:
    """`$DAGSTER_HOME`, default ./.dagster_home, holding this project's dagster.yaml."""
    home = Path(os.environ.get("DAGSTER_HOME") or Path.cwd() / DEFAULT_DAGSTER_HOME).resolve()
    home.mkdir(parents=True, exist_ok=True)
    os.environ["DAGSTER_HOME"] = str(home)
    target = home / "dagster.yaml"
    if not target.exists():
        shutil.copyfile(str(resources.files("eagle3_pipeline") / "dagster.yaml"), target)
    return home


def load_or_report(args: argparse.Namespace, runtime_checks: bool = True) -> PipelineConfig | None:
    """The pipeline file at ``args.config``, or None after printing why it is invalid. Its managed servers
    on an SSH host's loopback get their tunnels' routes (opened on first use, closed when the command ends)."""
    try:
        config = load_config(args.config, runtime_checks=runtime_checks)
    except ConfigError as exc:
        print(f"eagle3-pipeline: {exc}", file=sys.stderr)
        return None
    from eagle3_pipeline.managed.tunnels import declare_tunnels

    declare_tunnels(config)
    return config


def close_tunnels() -> None:
    """Close the tunnels a command opened (none when it declared none: nothing is imported for it)."""
    tunnel = sys.modules.get("eagle3_pipeline.hosts.tunnel")
    if tunnel is not None:
        tunnel.TUNNELS.close()
