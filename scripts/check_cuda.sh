#!/usr/bin/env bash
# The checks that need an NVIDIA GPU: the CUDA tests (CUDA graphs against eager launches, the
# scheduler and the HTTP server with --device cuda), then bench_one_batch on a random-weight model
# of the default model's shape, CUDA graphs and torch.compile against eager in one process each.
# Usage: bash scripts/check_cuda.sh [results-dir]   (airserve and its test extra installed, or
# PYTHONPATH holding python/ and test/ of this checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(mkdir -p "${1:-cuda_check}" && cd "${1:-cuda_check}" && pwd)"
export PYTHONPATH="$PWD/python:$PWD/test${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
  | tee -a "$out/gpu.txt"
status=0
python -m pytest -q -p no:cacheprovider -rs -m cuda \
  test/srt/model_executor/graph_runners/test_device_graph_runners.py test/srt/test_cuda_serving.py \
  2>&1 | tee "$out/pytest.txt" || status=1
model="$(mktemp -d)"
python -c "import sys; from airserve_testing.tiny_models import SMOLLM2_135M_SHAPE as s, \
make_tiny_model_dir as m; m(sys.argv[1], 'llama', **s)" "$model"
rm -f "$out/bench_one_batch.jsonl"
for compile in "" "--enable-torch-compile"; do
  python -m airserve.bench_one_batch --model-path "$model" --device cuda --dtype bfloat16 \
    --batch-size 1 16 64 --cuda-graph-bs 1 16 64 --input-len 128 --output-len 64 \
    --compare-eager $compile \
    --run-name "cuda-graph${compile:+-compile}" --result-file "$out/bench_one_batch.jsonl" \
    2>&1 | tee -a "$out/bench_one_batch.txt" || status=1
done
rm -rf "$model"
exit $status
