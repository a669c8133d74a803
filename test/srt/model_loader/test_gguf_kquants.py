"""GGUF files with K-quants and Q5_0/Q5_1: written with airserve's numpy K-quant quantizer
(read back by the gguf package), loaded as blocks only (no float32 copy), decoded through the
packed kernels.

References: `gguf.quants.dequantize` for the quantizer's blocks; the same file loaded with
--packed-decode-max-bs 0 (float32 weights dequantized by numpy) for the logits. Tolerance: 1e-4
(float32 activations: the same values, another summation order); int8 activations, teacher-
forced: logits within 8% (relative Frobenius norm) and >= 75% of the greedy tokens (a random
model amplifies the rounding; see the test).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from airserve.srt.layers.quant import block_matvec
from airserve.srt.model_loader.gguf_quantize import quantize
from airserve_testing.decode_driver import Requests
from airserve_testing.tiny_gguf import K_QUANT_TYPES, write_tiny_gguf

# Worst round-trip error allowed per super-block, as a fraction of its largest |x|: half a step
# of each sub-block's range, plus the 6-bit (8-bit for Q6_K) rounding of the scales.
_TOL = {"Q4_K": 0.1, "Q5_K": 0.06, "Q6_K": 0.03}


@pytest.mark.parametrize("name", sorted(_TOL))
def test_k_quantizer_round_trips_through_gguf(name: str) -> None:
    x = np.random.default_rng(0).normal(0, 1, size=(6, 512)).astype(np.float32)
    blocks = quantize(x, name)
    out = gguf.quants.dequantize(blocks, T[name]).reshape(x.shape)
    absmax = np.abs(x).reshape(-1, 256).max(axis=1, keepdims=True)
    err = np.abs(out - x).reshape(-1, 256)
    assert (err <= absmax * _TOL[name]).all()
    assert err.mean() < absmax.mean() * _TOL[name] / 4  # not all at the bound
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(x[:, :288], name)


def _logits(runner, prompts: list[list[int]], steps: int,
            feed: torch.Tensor | None = None) -> torch.Tensor:
    """Decode logits [steps, bs, vocab]: greedy, or teacher-forced with `feed`'s greedy tokens
    (the logits of another run) so both runs see the same inputs."""
    reqs = Requests(runner, prompts)
    ids, out = reqs.prefill_logits.argmax(-1).tolist(), []
    for i in range(steps):
        out.append(reqs.decode(ids))
        ids = (out[-1] if feed is None else feed[i]).argmax(-1).tolist()
    reqs.release()
    return torch.stack(out)


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("kq") / "m.gguf")
    write_tiny_gguf(path, "llama", qtypes=K_QUANT_TYPES, wide=True)
    return path


def test_loader_keeps_k_quants_as_blocks_only(kquant_file: str) -> None:
    from airserve.srt.layers.linear import Linear
    from airserve.srt.model_loader.loader import load_model

    _, model = load_model(kquant_file, "auto", "cpu", packed_decode_max_bs=4)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    kinds = {n.rsplit(".", 1)[-1]: m.packed_kinds for n, m in layers.items()}
    # Merged layers hold one block segment per kind, in output-row order.
    assert kinds == {"qkv_proj": ("q4_k", "q5_k", "q6_k"), "o_proj": ("q5_0",),
                     "gate_up_proj": ("q4_k", "q5_1"), "down_proj": ("q6_k",),
                     "lm_head": ("q8_0",)}
    for name, m in layers.items():  # only the tied lm_head (the embedding) has float32 values
        assert (m.weight is None) == (name != "lm_head"), name
    float_bytes = sum(p.numel() * 4 for p in model.parameters())
    _, plain = load_model(kquant_file, "auto", "cpu", packed_decode_max_bs=0)
    assert float_bytes < sum(p.numel() * 4 for p in plain.parameters()) / 2


@pytest.mark.parametrize("activations", ["float32", "int8", "auto"])
def test_k_quant_decode_matches_float32_weights(kquant_file: str, activations: str) -> None:
    """auto (the default): Q5_0 takes int8, Q4_K, Q6_K and the Q8_0 lm_head int16 where int16
    was measured faster, Q5_K and Q5_1 keep float32 activations
    (block_matvec.AUTO_INT8_KINDS / AUTO_INT16_KINDS; Q8_0 takes int8 in gate/up only,
    AUTO_INT8_ROLES, so the report names it with its role)."""
    from airserve.srt.model_executor.model_runner import ModelRunner
    from airserve.srt.server_args import ServerArgs

    # float32 pinned: under --dtype auto a CPU with avx512_bf16 or AMX multiplies the plain
    # runner (packed limit 0) in bfloat16.
    base = ServerArgs(model_path=kquant_file, max_total_tokens=512, max_running_requests=4,
                      dtype="float32")
    plain = ModelRunner(base.replace(packed_decode_max_bs=0))
    packed = ModelRunner(base.replace(packed_decode_max_bs=4, cpu_decode_activations=activations))
    report = packed.kernels_report()  # what /get_server_info shows under decode_kernels
    assert report["cpu_decode_activations"] == activations
    assert report["blocks_only_layers"] == report["linear_layers"] - 1  # all but the lm_head
    assert ("int8_isa" in report) == (activations != "float32")  # auto: int8 for q5_0
    if activations == "auto":
        k_act = "int16" if block_matvec.int16_measured_here() else "float32"
        assert report["activations_by_kind"] == {
            "q4_k": k_act, "q5_0": "int8", "q5_1": "float32", "q5_k": "float32",
            "q6_k": k_act, "q8_0:lm_head": k_act}
        assert "float32_isa" in report
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (5, 9, 3)]
    ref = _logits(plain, prompts, 8)  # prefill (> 4 rows) dequantizes per chunk in `packed`
    got = _logits(packed, prompts, 8, feed=ref)
    if activations == "float32":
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    else:
        rel = ((got - ref).norm() / ref.norm()).item()
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        # Each int8 product is ~0.6% off (the rounding of x to 8 bits); this random model
        # amplifies that to ~4% of its logits. test_fidelity.py checks a real model's numerics.
        assert 0 < rel < 0.08 and agree >= 0.75, (rel, agree)


def test_requantized_layers_keep_their_role_and_the_scheme_blocks() -> None:
    """gguf_quantize.requantize_linears (the fidelity and decode-step benchmarks' Q4_0 / K-quant
    files made from the default model): each layer holds the scheme's blocks (Q4_0 carried as
    q4_1 with m = -8 d), its float weight holds the same values, and it knows its role, so
    `auto` picks its activations as on a loaded file (for q4_1: int8 in gate_up_proj, int16 in
    the other layers)."""
    from airserve.srt.layers.linear import Linear
    from airserve.srt.layers.quant import block_matvec
    from airserve.srt.model_loader.gguf_quantize import requantize_linears, scheme_type

    if not block_matvec.kernels_available():
        pytest.fail(f"the block kernels did not build: {block_matvec.unavailable_reason()}")
    assert scheme_type("Q4_0", "model.layers.0.mlp.down_proj", 576) == "Q4_0"
    model = torch.nn.Module()
    model.gate_up_proj = Linear(64, 96, bias=False)
    model.down_proj = Linear(96, 64, bias=False)
    torch.manual_seed(0)
    for layer in (model.gate_up_proj, model.down_proj):
        torch.nn.init.normal_(layer.weight)
    assert requantize_linears(model, "Q4_0", 4, "auto") == {"Q4_0": 2}
    x = torch.randn(2, 64)
    for name, layer in (("gate_up_proj", model.gate_up_proj), ("down_proj", model.down_proj)):
        assert layer.packed_role == name and layer.packed_kinds == ("q4_1",)
        (part,) = layer.packed_parts
        assert torch.equal(part.dequantize(), layer.weight.detach())
        assert torch.equal(part.m, (-8 * part.d.float()).half())  # Q4_0: m = -8 d
        xin = x if name == "gate_up_proj" else torch.randn(2, 96)
        want = ("int8" if name == "gate_up_proj"
                else "int16" if block_matvec.int16_measured_here() else "float32")
        assert torch.equal(layer(xin, decode=True), block_matvec.packed_linear(xin, part, want))
