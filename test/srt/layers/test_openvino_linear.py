"""GGUF block weights as OpenVINO compressed weights (OpenVINOLinear).

Reference: `PackedWeight.dequantize()` (checked against the GGUF loader in test_gguf.py) and a
float32 matmul. Tolerance 1e-5 of the output scale, eager and compiled: both forms hold the
same values up to float32 rounding (the zero point -m / d rounds once per block).
The compiled tests read OpenVINO's compiled model to prove the matmuls take u4/i8 weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from airserve.srt.layers.linear import Linear
from airserve.srt.layers.quant.block_matvec import PackedWeight
from airserve.srt.layers.quant.openvino_linear import (
    OpenVINOLinear,
    u4_pairs,
    with_openvino_linears,
)
from airserve_testing.tiny_gguf import random_packed


def reference(x: torch.Tensor, packed: PackedWeight, bias) -> torch.Tensor:
    y = x @ packed.dequantize().T
    return y if bias is None else y + bias


def assert_close_to(y: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(y, ref, atol=1e-5 * ref.abs().max().item(), rtol=0)


def test_nibble_pairs_follow_the_k_order() -> None:
    # GGML block byte j: value j (low nibble), value j + 16 (high nibble).
    values = torch.arange(32, dtype=torch.uint8) % 16
    ggml = (values[:16] | (values[16:] << 4)).view(1, 16)
    packed = PackedWeight("q4_1", ggml, torch.ones(1, 1).half(), torch.zeros(1, 1).half())
    pairs = u4_pairs(packed.values())
    unpacked = torch.stack((pairs & 15, pairs >> 4), dim=-1).view(-1)
    assert torch.equal(unpacked, values)


@pytest.mark.parametrize("kind,zero_point", [("q4_1", True), ("q4_1", False), ("q8_0", True)])
@pytest.mark.parametrize("bias", [False, True])
def test_eager_forward_equals_the_dequantized_weight(kind, zero_point, bias) -> None:
    packed = random_packed(kind, 48, 96, flat_block=True)
    b = torch.randn(48) if bias else None
    layer = OpenVINOLinear(packed, None if b is None else nn.Parameter(b), zero_point)
    x = torch.randn(3, 96)
    assert_close_to(layer(x), reference(x, packed, b))
    assert (layer.zp is not None) == (kind == "q4_1" and zero_point)
    assert (layer.m is not None) == (kind == "q4_1" and not zero_point)


def test_unknown_kind_is_an_error() -> None:
    packed = random_packed("q8_0", 8, 32)
    with pytest.raises(ValueError, match="unknown block kind 'q5_k'"):
        OpenVINOLinear(PackedWeight("q5_k", packed.qs, packed.d, None))


class TwoLayers(nn.Module):
    def __init__(self, q4: PackedWeight, q8: PackedWeight) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(q4.shape[1])
        self.a = Linear(q4.shape[1], q4.shape[0], bias=True)
        self.b = Linear(q8.shape[1], q8.shape[0], bias=False)
        self.c = Linear(q8.shape[0], 8, bias=False)  # no blocks: stays a float Linear
        with torch.no_grad():
            self.a.weight.copy_(q4.dequantize())
            self.b.weight.copy_(q8.dequantize())
        self.a.attach_packed(q4, 0)
        self.b.attach_packed(q8, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(torch.relu(self.a(self.norm(x)))))


def two_layers() -> TwoLayers:
    return TwoLayers(random_packed("q4_1", 64, 96, flat_block=True),
                     random_packed("q8_0", 32, 64, seed=1))


def test_copy_replaces_block_layers_and_shares_every_other_tensor() -> None:
    model = two_layers()
    clone, replaced = with_openvino_linears(model)
    assert replaced == 2
    assert isinstance(clone.a, OpenVINOLinear) and isinstance(clone.b, OpenVINOLinear)
    assert type(clone.c) is Linear and clone.c.weight is model.c.weight
    assert clone.norm.weight is model.norm.weight and clone.a.bias is model.a.bias
    assert type(model.a) is Linear  # the original keeps its layers
    x = torch.randn(2, 96)
    assert_close_to(clone(x), model(x))


openvino = pytest.importorskip("openvino", reason="pip install airserve[openvino]")


@pytest.mark.parametrize("zero_point,dq", [(True, 0), (False, 0), (False, 32)])
def test_openvino_compiles_block_layers_to_compressed_matmuls(zero_point, dq) -> None:
    from airserve.srt.model_executor.graph_runners.openvino.compile import (
        OpenVINOCompiler,
        compile_options,
    )

    model = two_layers()
    clone, _ = with_openvino_linears(model, zero_point=zero_point)
    options = compile_options("CPU", "f32", 2, None, dynamic_quant_group_size=dq)
    compiler = OpenVINOCompiler(options, [*clone.parameters(), *clone.buffers()])
    fn = torch.compile(clone, backend=compiler, fullgraph=True, dynamic=False)
    x = torch.randn(4, 96)
    y = compiler.first_run(fn, x, device="CPU")
    types = compiler.matmul_weight_types()
    # The 4-bit and 8-bit weights stay compressed; only the block-less layer is float32.
    assert types.get("u4") == 1 and types.get("i8") == 1 and types.get("f32") == 1, types
    if not zero_point:
        assert types.get("f16") == 1  # the Q4_1 minimum's matmul
    with torch.no_grad():
        ref = model(x)
    if dq:  # int8 activations: close, not equal
        torch.testing.assert_close(y, ref, atol=0.05 * ref.abs().max().item(), rtol=0)
    else:
        assert_close_to(y, ref)


def test_bound_request_reads_its_inputs_in_place() -> None:
    """What OpenVINORunner replays through: an infer request bound to the graph's input tensors
    (new values in the same tensors are seen without passing them again); a tensor that is not
    one of the compiled model's inputs is an error, not a silent copy."""
    from airserve.srt.model_executor.graph_runners.openvino.compile import (
        OpenVINOCompiler,
        OpenVINOFallbackError,
        compile_options,
    )

    model = two_layers()
    clone, _ = with_openvino_linears(model)
    compiler = OpenVINOCompiler(compile_options("CPU", "f32", 2, None),
                                [*clone.parameters(), *clone.buffers()])
    fn = torch.compile(clone, backend=compiler, fullgraph=True, dynamic=False)
    x = torch.randn(4, 96)
    y = compiler.first_run(fn, x, device="CPU")
    with pytest.raises(OpenVINOFallbackError, match="model input 0 .* not one of the decode"):
        compiler.bind([torch.randn(4, 96)], [y])
    compiler.bind([x], [y])
    bound = compiler.request([x])
    x.copy_(torch.randn(4, 96))
    (out,) = bound()
    with torch.no_grad():
        assert_close_to(out, model(x))
    assert bound.calls == 1
    # Another request of the same compiled model reads other tensors in the same place.
    other = torch.randn(4, 96)
    (out,) = compiler.request([other])()
    with torch.no_grad():
        assert_close_to(out, model(other))


@pytest.mark.parametrize("bias", [False, True])
def test_merged_projections_become_one_compressed_layer(bias) -> None:
    """The model's merged q/k/v and gate/up layers become one OpenVINOLinear when their blocks
    share a kind, and a ConcatLinear of one per segment when they do not; both equal the
    layer's own product."""
    from airserve.srt.configs import ModelConfig
    from airserve.srt.layers.quant.openvino_linear import ConcatLinear
    from airserve.srt.models.llama import MLP, Attention
    from airserve_testing.tiny_models import tiny_config

    cfg = ModelConfig.from_hf_dict(dict(tiny_config("llama", 64), attention_bias=bias))
    attn, mlp = Attention(cfg, 0), MLP(cfg)

    def give_blocks(layer, kinds, seed):
        sizes = [s.size for s in getattr(layer, "shards", [])] or [layer.out_features]
        parts = [random_packed(k, n, layer.in_features, seed=seed + i)
                 for i, (k, n) in enumerate(zip(kinds, sizes))]
        with torch.no_grad():
            layer.weight.copy_(torch.cat([p.dequantize() for p in parts]))
            if layer.bias is not None:
                layer.bias.normal_()
        layer.attach_packed(parts, 0)

    give_blocks(attn.qkv_proj, ["q4_1"] * 3, 0)
    give_blocks(mlp.gate_up_proj, ["q4_1"] * 2, 3)
    give_blocks(mlp.down_proj, ["q4_1"], 5)
    block = nn.ModuleDict({"attn": attn, "mlp": mlp})
    clone, replaced = with_openvino_linears(block)
    assert replaced == 3 and attn.qkv_proj.packed_kinds == ("q4_1",)  # the original is kept
    assert isinstance(clone.attn.qkv_proj, OpenVINOLinear)
    assert isinstance(clone.mlp.gate_up_proj, OpenVINOLinear)
    assert isinstance(clone.mlp.down_proj, OpenVINOLinear)
    x = torch.randn(3, cfg.hidden_size)
    with torch.no_grad():
        assert_close_to(clone.attn.qkv_proj(x), attn.qkv_proj(x))
        assert_close_to(clone.mlp(x), mlp(x))
    # v of another block kind: q/k stay one segment, v a second.
    give_blocks(attn.qkv_proj, ["q4_1", "q4_1", "q8_0"], 7)
    assert attn.qkv_proj.packed_kinds == ("q4_1", "q8_0")
    clone, replaced = with_openvino_linears(block)
    assert isinstance(clone.attn.qkv_proj, ConcatLinear) and len(clone.attn.qkv_proj.parts) == 2
    assert replaced == 3
    with torch.no_grad():
        assert_close_to(clone.attn.qkv_proj(x), attn.qkv_proj(x))
