"""Decode-time products with GGML block-quantized weights, kept packed.

A GGUF model's linear weights are read from the file as blocks of 32 values with fp16 scales.
Besides the float32 copy that prefill uses, a `PackedWeight` keeps those blocks as they are, and
`packed_linear` multiplies small batches (decode) with them through two C++ operators
(`csrc/block_matvec.cpp`, built on first use): a step reads about a quarter of the float32
bytes. The operators compute in float32 from the exact block values, so they equal `x @ w.T`
with the dequantized weights up to summation order.

Every other kind the loader keeps packed (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: `RAW_KINDS`) is held as
the GGUF blocks' raw bytes and served by `csrc/block_int8.cpp`, in float32 or, for either form,
with int8 activations (`activations="int8"`: each row quantized per block of 32, integer dot
products with the blocks; AVX-512 VNNI, AVX-VNNI, AVX2 or portable code, chosen at run time);
Q4_1, Q8_0, Q4_K and Q6_K also with int16 activations (`activations="int16"`, `csrc/block_int16.cpp`
and `csrc/block_int16_k.cpp`: AVX2 or portable code);
`activations="auto"` (the server default) picks per kind
(`resolve_activations`). The server uses int8 for decode rows only: extend rows always take
float32 (`Linear.forward`).

If the operators cannot be built (no C++ compiler), `kernels_available()` says why once in the
log and the model keeps using its float32 weights; the model runner reports which path it uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
MAX_ROWS = 16  # the operators unpack a weight block once for at most this many rows of x

_lib = torch.library.Library("airserve", "FRAGMENT")
_lib.define("q4_1_matmul(Tensor x, Tensor qs, Tensor d, Tensor m) -> Tensor")
_lib.define("q8_0_matmul(Tensor x, Tensor qs, Tensor d) -> Tensor")
_lib.define("q4_1_matmul_i16(Tensor x, Tensor qs, Tensor d, Tensor m) -> Tensor")
_lib.define("q4_1_matmul_i16_portable(Tensor x, Tensor qs, Tensor d, Tensor m) -> Tensor")
_lib.define("q8_0_matmul_i16(Tensor x, Tensor qs, Tensor d) -> Tensor")
_lib.define("q8_0_matmul_i16_portable(Tensor x, Tensor qs, Tensor d) -> Tensor")
_lib.define("block_matmul_i16(Tensor x, str kind, Tensor qs) -> Tensor")
_lib.define("block_matmul_i16_portable(Tensor x, str kind, Tensor qs) -> Tensor")
_lib.define("block_matmul_int8(Tensor x, str kind, Tensor qs, Tensor? d, Tensor? m) -> Tensor")
_lib.define("block_matmul_f32(Tensor x, str kind, Tensor qs, Tensor? d, Tensor? m) -> Tensor")
_lib.define("dequantize_blocks(str kind, Tensor qs, Tensor? d, Tensor? m, int K) -> Tensor")

# kind -> (values per block, bytes per block) of the kinds kept as raw GGUF blocks.
RAW_KINDS = {"q5_0": (32, 22), "q5_1": (32, 24), "q4_k": (256, 144), "q5_k": (256, 176),
             "q6_k": (256, 210)}
KINDS = ("q4_1", "q8_0", *RAW_KINDS)
ACTIVATIONS = ("float32", "int8", "int16", "auto")
# Kinds with an int16-activation product (csrc/block_int16.cpp for q4_1, block_int16_k.cpp for
# the K-quants): each row quantized per block of 32 to int16 (error at most 1/65534 of the
# block's largest value), integer multiply-adds with the block values. "int16" asked of another
# kind multiplies in float32 (resolve_activations; /get_server_info's activations_by_kind shows
# which).
INT16_KINDS = frozenset({"q4_1", "q8_0", "q4_k", "q6_k"})
# Kinds whose products take int8 activations under "auto": int8 passed the fidelity check
# (benchmark/kernels/fidelity.py, ~2,000 tokens: top-1 agreement with float32 >= 98%, perplexity
# within 1%) and is faster than float32. The default model's Q4_1 file (Q4_1 layers, Q8_0
# lm_head) passed at 98.09% / +0.21%, and Q4_1's int8 products are 1.5-2.5x faster on AVX2
# (benchmark/kernels/bench_kernels.py). Q8_0 passed too but its int8 product is not faster on the
# lm_head shape (49152 x 576) on AVX2, so it stays float32; Q4_K_M (97.14%) and Q6_K (97.84%)
# failed on top-1 with int8 in every layer, so the K-quants stay float32. Q5_0, the kind most of
# a Q4_K_M file of this 576-wide model is made of, passed alone: the Q4_K_M mix with int8 in its
# Q5_0 layers only (`fidelity.py --schemes Q4_K_M --activations auto --auto-int8-kinds q5_0`,
# AVX2) 98.54% / +0.13%, and its int8 product is 1.2-1.6x faster than float32 (Q5_0 [1536, 576]
# bs 1: 58 vs 94 us, one thread, busy AMD EPYC). A mix all of Q5_0 (lm_head aside) gave 97.99%,
# one token of 1,992 under the bar; Q5_1 (no Q5_1 in these mixes) stays float32.
# Q4_1 left the set: on an AMD EPYC with AVX-512 (VNNI, bf16) the same check gave 97.49% /
# +0.16% (forced to AVX2 there, 98.14% again): the integer sums are exact on every path, but
# torch's, oneDNN's and our float32 kernels switch to AVX-512 and their last-bit differences
# move which activations round where; ~13 tokens flip. Int8 in every Q4_1 layer sits at the bar,
# above it on one CPU and below on another, so it is not a default (`--cpu-decode-activations
# int8` runs it); the layers where it keeps a margin are below (AUTO_INT8_ROLES).
AUTO_INT8_KINDS = frozenset({"q5_0"})
# Kinds that take int8 under "auto" in some layers only, by the layer's role (its module name in
# the model: "gate_up_proj", "down_proj", ...). The same check per role, on a 2-core AMD EPYC
# with AVX2 only (Zen 3), ~2,000 tokens, Q4_1 int8 in the named layers and float32 in the rest
# (lm_head too): gate_up 99.05% / +0.03%, down 99.30%, qkv 98.80%, gate_up + o 98.85%, gate_up +
# down 98.69%, gate_up + qkv 98.49%, every Q4_1 layer 97.84% / +0.22%, with the lm_head too 97.29%
# (benchmark/kernels/results/fidelity_q4_1_roles_amd_epyc_zen3_avx2.json). The merged gate/up
# projection, half of a layer's Q4_1 bytes and products, keeps a point of margin over the bar
# (the all-layers figure moved by 0.65 points between CPUs), so Q4_1 takes int8 there only.
# Q4_0 files are carried as q4_1 and follow the rule: the default model requantized to Q4_0
# (`fidelity.py --schemes Q4_0`), same CPU: gate_up 98.64% / +0.07%, every layer 97.14%
# (benchmark/kernels/results/fidelity_q4_0_roles_amd_epyc_zen3_avx2.json).
# Q8_0 follows the same rule (files of Q8_0 blocks, and the 576-wide layers of a Q6_K file,
# which llama.cpp stores as Q8_0): int8 in gate/up only, the default model requantized
# (`fidelity.py --schemes Q6_K Q8_0 --activations auto --int8-roles gate_up_proj
# gate_up_proj+o_proj`, same CPU): Q8_0 gate_up 99.00% / +0.13%, gate_up + o 99.00% / +0.15%;
# Q6_K mix with int8 in its Q8_0 gate/up 98.74% / +0.15%, gate_up + o 98.85% / -0.06%
# (benchmark/kernels/results/fidelity_q8_0_gate_up_int8_amd_epyc_zen3_avx2.json); the int8
# product is 1.2x faster than float32 there (bench_kernels.py, Q8_0 [1536, 576] bs 1: 65 vs 80
# us, 2 threads).
AUTO_INT8_ROLES: dict[str, frozenset[str]] = {"q4_1": frozenset({"gate_up_proj"}),
                                              "q8_0": frozenset({"gate_up_proj"})}
# Kinds whose other layers (those AUTO_INT8_ROLES leaves) take int16 activations under "auto".
# Q4_1 (and Q4_0, carried as q4_1): int16 in q/k/v, o and down besides int8 in gate/up passed
# the fidelity check on the 2-core AVX2 EPYC (Zen 3), the default file 99.40% / +0.17% (int8 in
# gate/up alone: 99.05% / +0.03%), Q4_0 98.85% / +0.04%; int16 in every Q4_1 layer 99.95%
# (benchmark/kernels/results/fidelity_q4_1_int16_auto_amd_epyc_zen3_avx2.json). The int16
# product is ~1.5x the float32 one there (one thread, bs 1: [576, 1536] 65.6 -> 39.6 us,
# [960, 576] 50.2 -> 33.4 us; bench_kernels.py), whose 4-bit-to-float conversions made it
# compute-bound; W1 1.09x (benchmark/throughput/ab_w1_activations.py).
# Q4_K and Q6_K (a Q4_K_M or Q6_K file's ffn_down on this 576-wide model; their int8 failed the
# check in every layer, 97.24% / 97.29%): int16 passed with margin on the same Zen 3 VM,
# `fidelity.py --schemes Q4_K_M Q6_K --activations auto int16`: the Q4_K_M mix under auto
# (int8 in its Q5_0 layers, int16 in its Q4_K / Q6_K ones) 98.39% / +0.08% (int8 in Q5_0 alone
# gave 98.54%), the Q6_K mix under auto 99.05% / -0.08%, int16 in every K-quant layer 99.95%
# both (benchmark/kernels/results/fidelity_k_quants_int16_auto_amd_epyc_zen3_avx2.json). Their
# int16 products are 1.4-2.2x the float32 ones there (csrc/block_int16_k.cpp).
# Q8_0 outside gate/up (q/k/v and o of a Q6_K file's 576-wide layers, the lm_head of every file
# here): its int16 product (csrc/block_int16.cpp) is 1.2-1.6x the float32 one on the same Zen 3
# VM, 2 threads, weights hot (one row: [49152, 576] 1142 -> 808 us, [960, 576] 33.5 -> 26.9,
# [576, 576] 25.1 -> 16.2). Fidelity with two sequences side by side, where int16 runs
# (`fidelity.py --schemes Q4_1 Q4_K_M Q6_K Q8_0 --activations auto --batch 2
# --auto-int16-kinds ...`), top-1 without / with Q8_0 int16: Q4_1 99.05 / 99.00%, Q4_K_M
# 98.20 / 98.15%, Q6_K 98.50 / 98.65%, Q8_0 99.00 / 98.85% (a token or three of 1,998;
# benchmark/kernels/results/fidelity_q8_0_int16_batch2_amd_epyc_zen3_avx2.json). W1 in one
# process, 6 alternating rounds (benchmark/throughput/ab_w1_activations.py): Q6_K file 103.9 ->
# 111.8 tok/s (median of per-round ratios 1.03x), the default Q4_1 file 134.9 -> 136.7 (1.00x:
# its only Q8_0 layer, the lm_head, streams from memory at about the same pace either way).
AUTO_INT16_KINDS = frozenset({"q4_1", "q8_0", "q4_k", "q6_k"})
# The int16 products serve decode batches of at most this many rows; larger ones multiply in
# float32 whatever the setting (more exact, and faster there). Each extra row costs the int16
# loop a vpmaddwd pair, a conversion and an FMA per block (~28 us a row for [1536, 576] Q4_1 on
# one thread) against the float32 loop's four FMAs on weights it unpacked once (~23 us), so
# int16 wins by the unpacking it saves at 1-2 rows and loses from ~4 on. One thread, AVX2 EPYC
# (Zen 3), float32 against int16 (us): Q4_1 [1536, 576] 1 row 77.9 / 52.6, 2 rows 113.7 /
# 80.6, 4 rows 170.6 / 181.7, 8 rows 241.0 / 359.5; [576, 1536] 67.6 / 43.3, 94.1 / 66.1, 158.0 /
# 139.0, 359.3 / 351.7. The C++ side of packed_or_large keeps the same limit
# (csrc/packed_or_large.cpp, kInt16MaxRows; test_block_int16.py compares them).
INT16_MAX_ROWS = 2
_INT16_HERE: list[bool] = []


def int16_measured_here() -> bool:
    """Whether "auto" takes int16 on this CPU: where the float32 products' best loop is the
    AVX2 one, the CPUs the int16 product (an AVX2 loop) was measured faster on. With AVX-512 the
    float32 products run 16-lane loops that the int16 one has not been measured against, so
    auto keeps float32 there (`--cpu-decode-activations int16` still runs it). Linear.attach_packed
    asks it eagerly, so that a compiled graph reads the stored answer (its torch op returns
    strings, which dynamo cannot trace)."""
    if not _INT16_HERE:
        _INT16_HERE.append(kernels_available() and float32_isas()[0] == "avx2")
    return _INT16_HERE[0]


def resolve_activations(activations: str, kind: str, role: str = "") -> str:
    """The activations a product of `kind` blocks uses in a layer whose role is `role`: "auto"
    picks int8 for `AUTO_INT8_KINDS` and for the roles `AUTO_INT8_ROLES` names for the kind,
    int16 for the other layers of `AUTO_INT16_KINDS` (on CPUs where it was measured faster:
    `int16_measured_here`), float32 (exact) for the rest; "int16"
    is int16 for `INT16_KINDS` and float32 for the other kinds."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations={activations!r}: must be one of {ACTIVATIONS}")
    if activations == "int16":
        return "int16" if kind in INT16_KINDS else "float32"
    if activations != "auto":
        return activations
    if kind in AUTO_INT8_KINDS or role in AUTO_INT8_ROLES.get(kind, ()):
        return "int8"
    if kind in AUTO_INT16_KINDS and int16_measured_here():
        return "int16"
    return "float32"


@torch.library.register_fake("airserve::q4_1_matmul")
def _q4_1_fake(x, qs, d, m):
    return x.new_empty(x.shape[0], qs.shape[0])


@torch.library.register_fake("airserve::q4_1_matmul_i16")
def _q4_1_i16_fake(x, qs, d, m):
    return x.new_empty(x.shape[0], qs.shape[0])


@torch.library.register_fake("airserve::q8_0_matmul")
def _q8_0_fake(x, qs, d):
    return x.new_empty(x.shape[0], qs.shape[0])


@torch.library.register_fake("airserve::q8_0_matmul_i16")
def _q8_0_i16_fake(x, qs, d):
    return x.new_empty(x.shape[0], qs.shape[0])


@torch.library.register_fake("airserve::block_matmul_i16")
def _i16_fake(x, kind, qs):
    return x.new_empty(x.shape[0], qs.shape[0])


@torch.library.register_fake("airserve::block_matmul_int8")
def _int8_fake(x, kind, qs, d, m):
    return x.new_empty(x.shape[0], qs.shape[0])


@torch.library.register_fake("airserve::block_matmul_f32")
def _f32_fake(x, kind, qs, d, m):
    return x.new_empty(x.shape[0], qs.shape[0])


@torch.library.register_fake("airserve::dequantize_blocks")
def _dequantize_fake(kind, qs, d, m, K):
    return qs.new_empty(qs.shape[0], K, dtype=torch.float32)


@dataclass
class PackedWeight:
    """A [N, K] weight in GGML blocks of 32 along K.

    kind "q4_1": qs uint8 [N, K/2] (byte j of a block: value j low nibble, value j+16 high),
    d and m float16 [N, K/32], value = d * q + m. kind "q8_0": qs int8 [N, K], d float16
    [N, K/32], m None, value = d * q. `RAW_KINDS`: qs uint8 [N, K / values * bytes], the GGUF
    blocks of each row as stored; d and m None.
    """

    kind: str
    qs: torch.Tensor
    d: torch.Tensor | None
    m: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        n = self.qs.shape[0]
        if self.kind in RAW_KINDS:
            values, nbytes = RAW_KINDS[self.kind]
            return (n, self.qs.shape[1] // nbytes * values)
        return (n, self.qs.shape[1] * (2 if self.kind == "q4_1" else 1))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m)
                   if t is not None)

    def values(self) -> torch.Tensor:
        """The integer values q of every block in K order: [N, K/32, 32], uint8 (q4_1, 0..15)
        or int8 (q8_0). Not defined for `RAW_KINDS`."""
        if self.kind in RAW_KINDS:
            raise ValueError(f"values() is for q4_1 / q8_0 blocks, not {self.kind}")
        n = self.qs.shape[0]
        if self.kind == "q8_0":
            return self.qs.view(n, -1, BLOCK)
        q = self.qs.view(n, -1, BLOCK // 2)
        return torch.cat([q & 15, q >> 4], dim=-1)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], the reference the operators are tested against (`RAW_KINDS`: the
        C++ operator, itself checked against gguf's numpy dequantization)."""
        if self.kind in RAW_KINDS:
            return torch.ops.airserve.dequantize_blocks(self.kind, self.qs, None, None,
                                                        self.shape[1])
        n = self.qs.shape[0]
        w = self.values().float() * self.d.float().unsqueeze(-1)
        if self.m is not None:
            w = w + self.m.float().unsqueeze(-1)
        return w.reshape(n, -1)


def block_matmul(x: torch.Tensor, kind: str, qs: torch.Tensor, d: torch.Tensor | None,
                 m: torch.Tensor | None, activations: str = "float32") -> torch.Tensor:
    """x: float32 [M <= MAX_ROWS, K] -> [M, N] = x @ dequantize(weight).T, for the weight
    whose `PackedWeight` fields are (kind, qs, d, m). activations "float32": exact block values
    times x in float32; "int8" / "int16": x quantized per block of 32, integer dot products
    (int16: `INT16_KINDS` only, float32 for the others and above `INT16_MAX_ROWS` rows); "auto":
    by kind (`resolve_activations`)."""
    act = resolve_activations(activations, kind)
    if act == "int16" and x.shape[0] > INT16_MAX_ROWS:
        act = "float32"
    if act == "int8":
        return torch.ops.airserve.block_matmul_int8(x, kind, qs, d, m)
    if act == "int16":  # resolve_activations: INT16_KINDS only
        if kind == "q4_1":
            return torch.ops.airserve.q4_1_matmul_i16(x, qs, d, m)
        if kind == "q8_0":
            return torch.ops.airserve.q8_0_matmul_i16(x, qs, d)
        return torch.ops.airserve.block_matmul_i16(x, kind, qs)
    if kind == "q4_1":
        return torch.ops.airserve.q4_1_matmul(x, qs, d, m)
    if kind == "q8_0":
        return torch.ops.airserve.q8_0_matmul(x, qs, d)
    return torch.ops.airserve.block_matmul_f32(x, kind, qs, d, m)


def packed_linear(x: torch.Tensor, w: PackedWeight, activations: str = "float32"
                  ) -> torch.Tensor:
    return block_matmul(x, w.kind, w.qs, w.d, w.m, activations)


def int8_isas() -> list[str]:
    """Instruction sets the int8 products can use on this CPU, best first (the first is used
    unless `use_int8_isa` narrowed it)."""
    return list(torch.ops.airserve_isa.int8_isas())


def int8_isa() -> str:
    """The instruction set the int8 products use now."""
    return str(torch.ops.airserve_isa.int8_isa())


def use_int8_isa(name: str) -> str:
    """Make the int8 products use `name` ("auto": the best this CPU has); tests and benchmarks
    use it to run every path the CPU supports. Raises RuntimeError for one it lacks."""
    return str(torch.ops.airserve_isa.set_int8_isa(name))


def float32_isas() -> list[str]:
    """Instruction sets the float32 products can use on this CPU, best first: "avx512",
    "avx2" (with FMA and F16C), "scalar" (plain C++)."""
    return list(torch.ops.airserve_isa.f32_isas())


def float32_isa() -> str:
    """The instruction set the float32 products use now."""
    return str(torch.ops.airserve_isa.f32_isa())


def use_float32_isa(name: str) -> str:
    """Make the float32 products use `name` ("auto": the best this CPU has), as
    `use_int8_isa` does for the int8 ones. Raises RuntimeError for one the CPU lacks."""
    return str(torch.ops.airserve_isa.set_f32_isa(name))


def kernels_available() -> bool:
    """Whether the C++ operators are built and loaded (see airserve.srt.layers.cpu_kernels)."""
    from airserve.srt.layers import cpu_kernels

    return cpu_kernels.available()


def unavailable_reason() -> str | None:
    from airserve.srt.layers import cpu_kernels

    return cpu_kernels.unavailable_reason()
