#!/usr/bin/env bash
# Install the benchmark peers (llama-cpp-python, the `peers` extra: benchmark/throughput/
# bench_w1.py) into the current Python environment, and check that llama.cpp runs a few tokens
# of the default model on this CPU before a benchmark relies on it.
#
# llama-cpp-python builds llama.cpp from source (~5-8 min on 2 cores) for the build machine's
# instructions. On CPUs with AMX (Sapphire Rapids and later) that build includes ggml's AMX
# matmul kernels; on a 2-core Sapphire Rapids VM they died with SIGSEGV at their first
# `ldtilecfg` (llama.cpp b-0.3.36, any thread count, flash attention on or off), so no W1
# comparison could run there. When the check fails on such a CPU, llama.cpp is rebuilt without
# the host-native flags, with the AVX-512 / VNNI / BF16 paths this CPU has named explicitly and
# AMX left out, and checked again. Its decode of one stream is memory-bound either way (AMX
# speeds up ggml's batched prompt products only). The result says which build is installed.
#
#   bash scripts/install_peers.sh            # after scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^peers = \["llama-cpp-python==\([0-9.]*\)"\]$/\1/p' pyproject.toml)
if [ -z "$version" ]; then
  echo "install_peers.sh: pyproject.toml's peers extra does not pin llama-cpp-python" >&2
  exit 1
fi

# Runs 4 greedy tokens of the default model's GGUF in a fresh process: 0 when llama.cpp works.
check() {
  python - <<'EOF'
import subprocess, sys
from airserve.srt.model_loader.loader import default_model_path
code = f"""
import llama_cpp
llm = llama_cpp.Llama(model_path={default_model_path()!r}, n_ctx=256, n_threads=2,
                      flash_attn=True, verbose=False)
ids = []
for tok in llm.generate([1, 2, 3, 4], top_k=1, temp=0.0, reset=True):
    ids.append(tok)
    if len(ids) == 4:
        break
print("llama.cpp ran 4 tokens:", ids)
"""
rc = subprocess.run([sys.executable, "-c", code]).returncode
if rc:
    print(f"llama.cpp failed its check (exit code {rc})", file=sys.stderr)
sys.exit(1 if rc else 0)
EOF
}

python -m pip install -q "llama-cpp-python==$version"
if check; then
  echo "llama-cpp-python $version: host-native build"
  exit 0
fi
if ! grep -qw amx_tile /proc/cpuinfo; then
  echo "install_peers.sh: llama.cpp fails on this CPU (no AMX, so not the known AMX fault)" >&2
  exit 1
fi
# This CPU's x86 extensions, named for ggml's CMake options (AMX off, GGML_NATIVE off).
args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx512f:AVX512 \
            avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 \
            avx_vnni:AVX_VNNI; do
  flag=${pair%%:*}
  option=${pair#*:}
  if grep -qw "$flag" /proc/cpuinfo; then args="$args -DGGML_$option=ON"; fi
done
echo "llama.cpp's AMX build fails here; rebuilding without AMX: $args"
CMAKE_ARGS="$args" python -m pip install -q --force-reinstall --no-deps --no-cache-dir \
  "llama-cpp-python==$version"
check
echo "llama-cpp-python $version: built without AMX ($args)"
