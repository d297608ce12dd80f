"""Code locations for one pipeline file, as a deployment of another pipeline would write them: a
python file whose `defs` are `build_definitions(load_config(file))`, and a workspace loading it."""

from __future__ import annotations

from pathlib import Path

LOCATION_NAME = "eagle3_pipeline"


def location_file(folder: Path, pipeline: Path) -> Path:
    """`folder/location.py`: the definitions of `pipeline` (loaded without the run-time checks)."""
    path = folder / "location.py"
    path.write_text(
        "from eagle3_pipeline.config import load_config\n"
        "from eagle3_pipeline.components import build_definitions\n\n"
        f"defs = build_definitions(load_config({str(pipeline.resolve())!r}, runtime_checks=False))\n"
    )
    return path


def workspace_file(folder: Path, pipeline: Path) -> Path:
    """`folder/workspace.yaml` loading :func:`location_file` as the location `eagle3_pipeline`."""
    path = folder / "workspace.yaml"
    path.write_text(
        "load_from:\n"
        "  - python_file:\n"
        f"      relative_path: {location_file(folder, pipeline).name}\n"
        f"      location_name: {LOCATION_NAME}\n"
    )
    return path
