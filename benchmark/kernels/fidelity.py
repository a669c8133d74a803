"""Fidelity of airserve's inexact CPU paths against the exact float32 ones.

Two checks, both teacher-forced over ~2,000 tokens of the packaged text, both passing at top-1
agreement >= 98% and perplexity within 1% of float32:

- `--paths bfloat16 float16_weights w8a8_int8 w8a8_int8_outliers`: the matmul paths of prefill
  and large batches (layers/quant/matmul_paths.py). The text is split into sequences of
  `--seq-len` tokens, each prefilled in one forward pass with every position's logits, so every
  linear layer (lm_head too) multiplies through the path; compared with the float32 path on the
  same model.
- `--kv-cache-dtypes bfloat16 float16`: the KV cache's element type. Every position is a
  decode step (below) that writes its K/V into the cache and attends over the cache as decode
  attention reads it, on the default model; each dtype is checked twice against float32 KV
  with float32 matmuls: with float32 matmuls (the cache alone), and with every row, decode rows
  too, multiplied through the path `auto` takes for large batches on this CPU (bfloat16 where
  it has bf16 dot products, float16_weights on other x86 CPUs with AVX2): the two roundings
  together.
  `int8-keys` / `int8-values` emulate a cache that would hold only the keys (values) as int8
  rows: a float16 cache whose keys (values) take the int8 row format's round trip (values and
  scale, the C++ quantizer) before they are written; float16 then rounds the dequantized
  value again, so the emulation is if anything pessimistic.
- default: int8 activations of the packed decode kernels, below.

For each GGUF type (the default model's Q4_1 as shipped, and K-quant / Q5 mixes made by
requantizing its dequantized weights: `gguf_quantize.SCHEMES`), the text (~2,000 tokens of the
packaged GSM8K) is split into `--batch` sequences and fed teacher-forced through decode steps,
so every linear layer runs in the packed kernels. Every position is a decode row, the first
too (a decode step over a one-token context): extends multiply in float32 whatever
--cpu-decode-activations says (Linear.forward), so a prefill there would hide int8 from the
first position and its KV. Per configuration (`--activations`: "int8" in every packed layer,
and "auto" as the server runs it, int8 only for the kinds block_matvec.AUTO_INT8_KINDS names,
so the Q4_1 file's Q8_0 lm_head stays float32) it reports top-1 agreement with the
float32-activation run on the same weights, and both perplexities. `--auto-int8-kinds` runs
"auto" under a candidate rule instead (int8 only for the kinds named, e.g. q5_0 q5_1 in a
Q4_K_M mix), the check a kind must pass before it joins AUTO_INT8_KINDS.
`--int8-roles gate_up_proj gate_up_proj+o_proj` adds configurations with int8 in the layers of
those roles only (float32 in the rest, the lm_head too unless named), the check behind
block_matvec.AUTO_INT8_ROLES, which "auto" follows.
Pass: agreement >= 98% and perplexity within 1%; the exit code is the "auto" rows' verdict.

    python benchmark/kernels/fidelity.py [--tokens 2000] [--schemes Q4_1 Q4_K_M ...] [--json F]
    python benchmark/kernels/fidelity.py --schemes Q4_K_M --activations auto \
        --auto-int8-kinds q5_0 q5_1
    python benchmark/kernels/fidelity.py --schemes Q4_1 --int8-roles gate_up_proj down_proj
    python benchmark/kernels/fidelity.py --paths bfloat16 w8a8_int8 w8a8_int8_outliers \
        [--seq-len 250] [--int8-outlier-channels N] [--json F]
    python benchmark/kernels/fidelity.py --kv-cache-dtypes bfloat16 [--batch 8] [--json F]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import resource
import time

import torch

MIN_AGREEMENT = 0.98
MAX_PPL_CHANGE = 0.01
DEFAULT_SCHEMES = ("Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K")
KV_EMULATED = ("int8-keys", "int8-values")


@contextlib.contextmanager
def int8_round_trip(which: str | None):
    """Within the block, the CPU attention backend's keys ("int8-keys") or values
    ("int8-values") pass through the int8 cache row format before the write; None: as they
    are."""
    from airserve.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from airserve.srt.mem_cache.memory_pool import kv_rows, kv_values

    if which is None:
        yield
        return
    forward = TorchNativeAttnBackend.forward
    own = "forward" in vars(TorchNativeAttnBackend)

    def emulated(self, q, k, v, *args, **kwargs):
        if which == "int8-keys":
            k = kv_values(kv_rows(k, torch.int8), k.dtype)
        else:
            v = kv_values(kv_rows(v, torch.int8), v.dtype)
        return forward(self, q, k, v, *args, **kwargs)

    TorchNativeAttnBackend.forward = emulated
    try:
        yield
    finally:
        if own:
            TorchNativeAttnBackend.forward = forward
        else:
            del TorchNativeAttnBackend.forward


def packaged_text(n_chars: int = 20000) -> str:
    """GSM8K questions and answers from the packaged data, ~n_chars characters."""
    from airserve.benchmark.datasets import load_gsm8k

    parts, size = [], 0
    for row in load_gsm8k():
        parts.append(f"Question: {row['question']}\nAnswer: {row['answer']}\n\n")
        size += len(parts[-1])
        if size >= n_chars:
            break
    return "".join(parts)


def make_runner(scheme: str, activations: str, batch: int, seq_len: int):
    """A ModelRunner over the default model with its linear layers in `scheme` blocks."""
    from airserve.srt.model_executor.model_runner import ModelRunner
    from airserve.srt.model_loader.gguf_quantize import requantize_linears
    from airserve.srt.model_loader.loader import load_model
    from airserve.srt.server_args import ServerArgs

    args = ServerArgs(max_total_tokens=batch * (seq_len + 8), max_running_requests=batch,
                      packed_decode_max_bs=batch, cpu_decode_activations=activations)
    cfg, model = load_model(None, "float32", "cpu", None, batch, False, activations)
    if scheme != "Q4_1":
        requantize_linears(model, scheme, batch, activations)
    return ModelRunner(args, model_config=cfg, model=model)


def set_activations(model: torch.nn.Module, activations: str) -> int:
    """Switch every packed layer's products to `activations`, or for "roles:A+B" int8 in the
    layers whose role (Linear.packed_role: "gate_up_proj", "lm_head", ...) is A or B and
    float32 in the others; returns how many layers."""
    from airserve.srt.layers.linear import Linear

    layers = [m for m in model.modules() if isinstance(m, Linear) and m.packed_max_rows]
    roles = _int8_roles(activations)
    for m in layers:
        m.packed_activations = (activations if roles is None
                                else "int8" if m.packed_role in roles else "float32")
    return len(layers)


def _int8_roles(activations: str) -> set[str] | None:
    """The roles of a "roles:A+B" configuration, None for any other."""
    return set(activations.split(":", 1)[1].split("+")) if activations.startswith(
        "roles:") else None


def _roles_text(roles: dict[str, frozenset[str]]) -> str:
    return "; ".join(f"{kind} {'/'.join(sorted(r))}" for kind, r in sorted(roles.items()))


def weight_mib(model: torch.nn.Module) -> float:
    """MiB of distinct tensor storage held by the model's parameters and buffers."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        if t is None or t.device.type == "meta" or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.untyped_storage().nbytes()
    return total / 2**20


@torch.inference_mode()
def teacher_forced(runner, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed `seqs` (equal lengths) one token per decode step, from position 0 (a decode row over
    the one token just written: the packed products take the configured activations). Returns
    the greedy token and the log-probability of the true next token at every position but the
    last: [bs, len - 1]."""
    from airserve.srt.forward_batch import ForwardMode

    alloc, pool = runner.allocator, runner.req_to_token_pool
    slots = [pool.allocate() for _ in seqs]
    top1, logp = [], []
    for pos in range(len(seqs[0]) - 1):
        locs = torch.cat([alloc.allocate(s, pos, pos + 1) for s in slots])
        fb = runner.make_forward_batch(
            ForwardMode.DECODE, input_ids=[s[pos] for s in seqs], positions=[pos] * len(seqs),
            req_pool_indices=slots, seq_lens=[pos + 1] * len(seqs), out_cache_loc=locs)
        logits = runner.forward(fb).float()
        nxt = torch.tensor([s[pos + 1] for s in seqs])
        top1.append(logits.argmax(-1))
        logp.append(torch.log_softmax(logits, -1).gather(1, nxt[:, None])[:, 0])
    for s in slots:
        alloc.free(s, len(seqs[0]) - 1)
        pool.free(s)
    return torch.stack(top1, 1), torch.stack(logp, 1)


@contextlib.contextmanager
def auto_rules(kinds: frozenset[str] | None, int16_kinds: frozenset[str] | None = None):
    """Within the block, "auto" takes int8 for `kinds` and int16 for `int16_kinds` (None: the
    shipped rule). The rules are read when each product runs (block_matvec.resolve_activations),
    so this swaps them for the run and puts the shipped ones back."""
    from airserve.srt.layers.quant import block_matvec

    shipped = block_matvec.AUTO_INT8_KINDS, block_matvec.AUTO_INT16_KINDS
    if kinds is not None:
        block_matvec.AUTO_INT8_KINDS = kinds
    if int16_kinds is not None:
        block_matvec.AUTO_INT16_KINDS = int16_kinds
    try:
        yield
    finally:
        block_matvec.AUTO_INT8_KINDS, block_matvec.AUTO_INT16_KINDS = shipped


def default_tokens(n_tokens: int) -> tuple[object, list[int]]:
    """The default model's tokenizer and the first `n_tokens` tokens of the packaged text."""
    from airserve.srt.model_loader.loader import default_model_path
    from airserve.srt.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(default_model_path())
    tokens = list(tokenizer.encode(packaged_text()))[:n_tokens]
    if len(tokens) < n_tokens:
        raise ValueError(f"the packaged text has only {len(tokens)} tokens")
    return tokenizer, tokens


def split(tokens: list[int], batch: int) -> list[list[int]]:
    n = len(tokens) // batch
    return [tokens[i * n:(i + 1) * n] for i in range(batch)]


def check(schemes: list[str], n_tokens: int, batch: int, isas: list[str] | None = None,
          activations: tuple[str, ...] = ("int8", "auto"),
          auto_kinds: frozenset[str] | None = None,
          auto_int16_kinds: frozenset[str] | None = None) -> dict:
    """Run every scheme with float32 activations, then with each of `activations` ("int8":
    every packed layer; "auto": what --cpu-decode-activations auto runs, int8 only for the
    kinds block_matvec.resolve_activations gives it, or for `auto_kinds` if given), int8 on
    each of `isas` (default: the best this CPU has); returns the report."""
    from airserve.srt.layers.quant import block_matvec

    _, tokens = default_tokens(n_tokens)
    seqs = split(tokens, batch)
    rows = []
    for scheme in schemes:
        t0 = time.perf_counter()
        runner = make_runner(scheme, "float32", batch, len(seqs[0]))
        ref_top1, ref_logp = teacher_forced(runner, seqs)
        ref_ppl = math.exp(-ref_logp.mean().item())
        mib = weight_mib(runner.model)
        for act in activations:
            set_activations(runner.model, act)
            for isa in isas or [block_matvec.int8_isas()[0]]:
                block_matvec.use_int8_isa(isa)
                with auto_rules(auto_kinds if act == "auto" else None,
                                auto_int16_kinds if act == "auto" else None):
                    top1, logp = teacher_forced(runner, seqs)
                int8_kinds = sorted(auto_kinds if auto_kinds is not None
                                    else block_matvec.AUTO_INT8_KINDS)
                roles = _int8_roles(act)
                if roles is not None:  # int8 in the named layers, whatever the kind
                    int8_kinds = sorted(roles)
                ppl = math.exp(-logp.mean().item())
                agree = (top1 == ref_top1).float().mean().item()
                change = abs(ppl / ref_ppl - 1)
                int16_kinds = (sorted(auto_int16_kinds if auto_int16_kinds is not None
                                      else block_matvec.AUTO_INT16_KINDS)
                               if act == "auto" and block_matvec.int16_measured_here()
                               else sorted(block_matvec.INT16_KINDS) if act == "int16" else [])
                rows.append({"scheme": scheme, "activations": act, "isa": isa,
                             "int8_kinds": (int8_kinds if act not in ("int8", "int16")
                                            else "all" if act == "int8" else []),
                             "int16_kinds": int16_kinds,
                             "tokens": int(top1.numel()), "ppl_float32": ref_ppl,
                             "ppl_int8": ppl, "ppl_change": change, "top1_agreement": agree,
                             "weight_mib": mib,
                             "passed": agree >= MIN_AGREEMENT and change <= MAX_PPL_CHANGE,
                             "seconds": time.perf_counter() - t0})
                kinds = f" (int8: {', '.join(int8_kinds)})" if act == "auto" else ""
                if int16_kinds:
                    kinds += f" (int16: {', '.join(int16_kinds)})"
                if act == "auto" and block_matvec.AUTO_INT8_ROLES:
                    kinds += f" (by role: {_roles_text(block_matvec.AUTO_INT8_ROLES)})"
                print(f"{scheme} {act}{kinds} {isa}: top-1 {agree:.2%}, perplexity "
                      f"{ref_ppl:.3f} -> {ppl:.3f}", flush=True)
        block_matvec.use_int8_isa("auto")
        del runner
    return {"rows": rows, "float32_isa": block_matvec.float32_isa(),
            "min_agreement": MIN_AGREEMENT, "max_ppl_change": MAX_PPL_CHANGE,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "passed": all(r["passed"] for r in rows if r["activations"] == "auto")}


@torch.inference_mode()
def teacher_forced_prefill(runner, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill each sequence in one forward pass with every position's logits. Returns the
    greedy token and the log-probability of the true next token at every position but the
    last: [len(seqs), len - 1]."""
    from airserve.srt.forward_batch import ForwardMode

    alloc, pool = runner.allocator, runner.req_to_token_pool
    top1, logp = [], []
    for seq in seqs:
        slot, n = pool.allocate(), len(seq)
        fb = runner.make_forward_batch(
            ForwardMode.EXTEND, input_ids=seq, positions=range(n), req_pool_indices=[slot],
            seq_lens=[n], out_cache_loc=alloc.allocate(slot, 0, n), extend_seq_lens=[n],
            extend_prefix_lens=[0], last_token_indices=[n - 1], return_all_logits=True)
        logits = runner.forward(fb).float()[:-1]
        top1.append(logits.argmax(-1))
        logp.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0])
        alloc.free(slot, n)
        pool.free(slot)
    return torch.stack(top1), torch.stack(logp)


def compare(ref: tuple[torch.Tensor, torch.Tensor], got: tuple[torch.Tensor, torch.Tensor]
            ) -> dict:
    """Top-1 agreement and perplexities of `got` (top1, logp) against `ref`, and the verdict."""
    ref_ppl, ppl = (math.exp(-logp.mean().item()) for _, logp in (ref, got))
    agree = (got[0] == ref[0]).float().mean().item()
    change = abs(ppl / ref_ppl - 1)
    return {"tokens": int(got[0].numel()), "ppl_float32": ref_ppl, "ppl": ppl,
            "ppl_change": change, "top1_agreement": agree,
            "passed": agree >= MIN_AGREEMENT and change <= MAX_PPL_CHANGE}


def make_path_runner(model_path: str | None, n_seqs: int, seq_len: int):
    """A ModelRunner over a GGUF model (default: the packaged one), float32 path, packed
    decode kernels on as served (their limit is far below `seq_len`)."""
    from airserve.srt.model_executor.model_runner import ModelRunner
    from airserve.srt.model_loader.loader import load_model
    from airserve.srt.server_args import ServerArgs

    args = ServerArgs(model_path=model_path, dtype="float32", max_running_requests=n_seqs,
                      max_total_tokens=n_seqs * (seq_len + 8))
    cfg, model = load_model(model_path, "float32", "cpu", None, args.packed_decode_max_bs)
    return ModelRunner(args, model_config=cfg, model=model)


def compare_paths(runner, seqs: list[list[int]], paths: list[str], tokenizer=None,
                  outlier_channels: int | None = None) -> list[dict]:
    """Each of `paths` against the float32 path on `runner`'s model (left on float32).
    w8a8_int8_outliers and bfloat16 calibrate their float32 channels with `tokenizer` first
    (the loader's calibration text, not the scored one)."""
    from airserve.srt.model_loader.loader import large_path_outliers, set_large_path

    ref = teacher_forced_prefill(runner, seqs)
    rows = []
    for path in paths:
        t0 = time.perf_counter()
        outliers = large_path_outliers(runner.model, tokenizer, path, outlier_channels)
        set_large_path(runner.model, path, outliers=outliers)
        row = {"path": path, **compare(ref, teacher_forced_prefill(runner, seqs)),
               "weight_mib": weight_mib(runner.model), "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(f"{path}: top-1 {row['top1_agreement']:.2%}, perplexity {row['ppl_float32']:.3f} "
              f"-> {row['ppl']:.3f}", flush=True)
    set_large_path(runner.model, "float32")
    return rows


def check_paths(paths: list[str], n_tokens: int, seq_len: int,
                outlier_channels: int | None = None) -> dict:
    """The matmul paths' check on the default model over `n_tokens` of the packaged text."""
    tokenizer, tokens = default_tokens(n_tokens)
    seqs = split(tokens, max(1, n_tokens // seq_len))
    rows = compare_paths(make_path_runner(None, len(seqs), len(seqs[0])), seqs, paths,
                         tokenizer, outlier_channels)
    return {"rows": rows, "min_agreement": MIN_AGREEMENT, "max_ppl_change": MAX_PPL_CHANGE,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "passed": {r["path"]: r["passed"] for r in rows}}


LARGE_DECODE_LIMIT = 8  # the packed limit of the large-decode check (the CPU default)


def check_large_decode(role_sets: list[str], n_tokens: int, batch: int) -> dict:
    """int8_blocks in decode batches above the packed limit: the text decoded teacher-forced,
    `batch` (> LARGE_DECODE_LIMIT) sequences side by side, so every step's products take the
    large path; float32 is the reference, then float16_weights alone, then float16_weights with
    int8_blocks in the Q4_1 layers of each "ROLE/ROLE" set (Linear.set_large_int8; "ROLE/ROLE@K":
    not in the first or last K decoder layers), or in the layers --cpu-large-activations auto
    gives it for the set "auto" (loader.int8_blocks_layers: its roles, not at the model's
    ends)."""
    from airserve.srt.layers.linear import Linear
    from airserve.srt.model_executor.model_runner import ModelRunner
    from airserve.srt.model_loader.loader import (
        decoder_layer_index,
        int8_blocks_layers,
        load_model,
        set_large_path,
    )
    from airserve.srt.server_args import ServerArgs

    if batch <= LARGE_DECODE_LIMIT:
        raise SystemExit(f"--batch {batch}: the large-decode check needs more rows than the "
                         f"packed limit ({LARGE_DECODE_LIMIT})")
    _, tokens = default_tokens(n_tokens)
    seqs = split(tokens, batch)
    args = ServerArgs(max_total_tokens=batch * (len(seqs[0]) + 8), max_running_requests=batch,
                      packed_decode_max_bs=LARGE_DECODE_LIMIT)
    cfg, model = load_model(None, "float32", "cpu", None, LARGE_DECODE_LIMIT, False, "auto")
    runner = ModelRunner(args, model_config=cfg, model=model)
    ref = teacher_forced(runner, seqs)
    set_large_path(model, "float16_weights")
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    auto = {n for n, _ in int8_blocks_layers(model, "auto", "float16_weights")}
    index = {n: decoder_layer_index(n) for n, _ in layers}
    n_layers = 1 + max(i for i in index.values() if i is not None)
    rows = []
    for roles in ["", *role_sets]:
        spec, _, edge = roles.partition("@")
        names, edge = set(spec.split("/")) if spec else set(), int(edge or 0)
        inside = {n for n, i in index.items() if i is not None and edge <= i < n_layers - edge}
        for n, m in layers:
            on = (n in auto if roles == "auto" else
                  m.packed_role in names and n in inside
                  and m.takes_int8_blocks("int8", "float16_weights"))
            if on or m.large_int8:
                m.set_large_int8(on)
        rows.append({"int8_roles": roles or "-", "matmul_path": "float16_weights",
                     "int8_layers": sum(m.large_int8 for _, m in layers),
                     **compare(ref, teacher_forced(runner, seqs))})
        print(f"int8 in {roles or 'no layer'}: top-1 {rows[-1]['top1_agreement']:.2%}",
              flush=True)
    return {"rows": rows, "batch": batch, "packed_limit": LARGE_DECODE_LIMIT,
            "min_agreement": MIN_AGREEMENT, "max_ppl_change": MAX_PPL_CHANGE,
            "passed": all(r["passed"] for r in rows)}


def check_kv(kv_dtypes: list[str], n_tokens: int, batch: int) -> dict:
    """The KV cache dtypes' check (module docstring) on the default model over `n_tokens` of
    the packaged text, decoded teacher-forced `batch` sequences side by side."""
    from airserve.srt.hardware import host_cpu
    from airserve.srt.layers.quant.path_choice import (
        FLOAT16_KV_PATHS,
        cpu_has_bf16,
        fbgemm_cpu,
        int8_available,
    )
    from airserve.srt.model_executor.model_runner import ModelRunner
    from airserve.srt.model_loader.loader import large_path_outliers, load_model, set_large_path
    from airserve.srt.server_args import ServerArgs

    tokenizer, tokens = default_tokens(n_tokens)
    seqs = split(tokens, batch)
    # No packed decode kernels: every row multiplies through the large path, so that the
    # bfloat16 configurations round decode rows as a large batch does.
    cfg, model = load_model(None, "float32", "cpu", None, 0)
    flags = host_cpu()[1]
    # The float32 reference first, then the paths `auto` pairs with a float16 pool that run on
    # this CPU (each frees the float32 weights, which nothing brings back).
    runs_here = {"bfloat16": cpu_has_bf16(flags),
                 "float16_weights": fbgemm_cpu(flags) and int8_available()}
    paths = ["float32"] + [p for p in FLOAT16_KV_PATHS if runs_here[p]]
    outliers = large_path_outliers(model, tokenizer, "bfloat16") if "bfloat16" in paths else None

    current = ["float32"]

    def run(kv_dtype: str, path: str) -> tuple[torch.Tensor, torch.Tensor]:
        if path != current[0]:
            set_large_path(model, path, outliers=outliers if path == "bfloat16" else None)
            current[0] = path
        emulated = kv_dtype if kv_dtype in KV_EMULATED else None
        args = ServerArgs(dtype="float32", kv_cache_dtype="float16" if emulated else kv_dtype,
                          max_running_requests=batch,
                          max_total_tokens=batch * (len(seqs[0]) + 8), packed_decode_max_bs=0)
        with int8_round_trip(emulated):
            return teacher_forced(ModelRunner(args, model_config=cfg, model=model), seqs)

    ref = run("float32", "float32")
    rows = []
    for path in paths:
        for kv in kv_dtypes:
            t0 = time.perf_counter()
            row = {"kv_cache_dtype": kv, "matmul_path": path, **compare(ref, run(kv, path)),
                   "seconds": time.perf_counter() - t0}
            rows.append(row)
            print(f"kv {kv}, matmuls {path}: top-1 {row['top1_agreement']:.2%}, perplexity "
                  f"{row['ppl_float32']:.3f} -> {row['ppl']:.3f}", flush=True)
    return {"rows": rows, "min_agreement": MIN_AGREEMENT, "max_ppl_change": MAX_PPL_CHANGE,
            "cpu": host_cpu()[0], "attention_isa": _attention_isa(),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "passed": all(r["passed"] for r in rows)}


def _attention_isa() -> str | None:
    from airserve.srt.layers import cpu_kernels

    if not cpu_kernels.available():
        return None
    from airserve.srt.layers.attention import torch_native_backend as tnb

    return tnb.attention_isa()


def print_compare_table(report: dict, keys: list[tuple[str, str, int]],
                        seconds: bool = False) -> None:
    """The rows of `compare` results in `report`, led by `keys` (header, field, width)."""
    lead = " ".join(f"{head:{width}}" for head, _, width in keys)
    print(f"{lead} {'tokens':>6} {'ppl f32':>8} {'ppl':>8} {'change':>7} {'top-1':>7}"
          + (f" {'seconds':>7}" if seconds else "") + "  pass")
    for r in report["rows"]:
        lead = " ".join(f"{r[field]:{width}}" for _, field, width in keys)
        secs = f" {r['seconds']:7.0f}" if seconds else ""
        print(f"{lead} {r['tokens']:6d} {r['ppl_float32']:8.3f} {r['ppl']:8.3f} "
              f"{r['ppl_change']:7.2%} {r['top1_agreement']:7.2%}{secs}  "
              f"{'yes' if r['passed'] else 'NO'}")


def print_table(report: dict) -> None:
    w = max([5] + [len(r["activations"]) for r in report["rows"]])
    print(f"{'type':8} {'acts':{w}} {'isa':12} {'tokens':>6} {'ppl f32':>8} {'ppl int8':>8} "
          f"{'change':>7} {'top-1':>6} {'weights':>9}  pass")
    for r in report["rows"]:
        print(f"{r['scheme']:8} {r['activations']:{w}} {r['isa']:12} {r['tokens']:6d} "
              f"{r['ppl_float32']:8.3f} {r['ppl_int8']:8.3f} {r['ppl_change']:7.2%} "
              f"{r['top1_agreement']:6.2%} {r['weight_mib']:6.0f} MiB  "
              f"{'yes' if r['passed'] else 'NO'}")
    print(f"thresholds: top-1 agreement >= {MIN_AGREEMENT:.0%}, perplexity within "
          f"{MAX_PPL_CHANGE:.0%}; peak RSS {report['peak_rss_mib']:.0f} MiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--batch", type=int, default=8, help="sequences decoded side by side")
    p.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES))
    p.add_argument("--all-isas", action="store_true",
                   help="int8 on every instruction set this CPU has, not only the best")
    p.add_argument("--activations", nargs="+", default=["int8", "auto"],
                   choices=("int8", "int16", "auto"),
                   help="int8: every packed layer; int16: every Q4_1 layer (other kinds "
                        "float32); auto: as --cpu-decode-activations auto runs")
    p.add_argument("--auto-int8-kinds", nargs="+", default=None,
                   help="run auto with int8 for these kinds only (a candidate rule; default: "
                        "block_matvec.AUTO_INT8_KINDS)")
    p.add_argument("--auto-int16-kinds", nargs="+", default=None,
                   help="run auto with int16 for these kinds (where int16 runs: decode batches "
                        "of at most block_matvec.INT16_MAX_ROWS rows, so pair it with --batch 2; "
                        "default: block_matvec.AUTO_INT16_KINDS)")
    p.add_argument("--int8-roles", nargs="+", default=[],
                   help="also run int8 in the layers of these roles only, float32 elsewhere: "
                        "each a role set, e.g. gate_up_proj gate_up_proj+o_proj (roles: "
                        "qkv_proj, o_proj, gate_up_proj, down_proj, lm_head); a candidate for "
                        "block_matvec.AUTO_INT8_ROLES")
    p.add_argument("--isa", default=None,
                   help="int8 on this instruction set (e.g. avx2) instead of the best")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--paths", nargs="+", default=None,
                   choices=("bfloat16", "float16_weights", "w8a8_int8", "w8a8_int8_outliers"),
                   help="check these prefill / large-batch matmul paths instead")
    p.add_argument("--large-decode-int8-roles", nargs="+", default=None,
                   help="check int8_blocks in decode batches above the packed limit instead: "
                        "one configuration per ROLE[/ROLE...][@K] (e.g. gate_up_proj/down_proj; "
                        "@K: not in the first or last K decoder layers) or 'auto' (the layers "
                        "--cpu-large-activations auto gives it), --batch rows a step (above the "
                        "limit of 8)")
    p.add_argument("--int8-outlier-channels", type=int, default=None,
                   help="w8a8_int8_outliers: float32 input channels per layer (default: the "
                        "server's)")
    p.add_argument("--seq-len", type=int, default=250, help="tokens per sequence (--paths)")
    p.add_argument("--kv-cache-dtypes", nargs="+", default=None,
                   choices=("bfloat16", "float16", "int8") + KV_EMULATED,
                   help="check these KV cache element types instead (int8-keys/-values: "
                        "emulated, see above)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.kv_cache_dtypes:
        report = check_kv(a.kv_cache_dtypes, a.tokens, a.batch)
        print_compare_table(report, [("kv cache", "kv_cache_dtype", 9),
                                     ("matmuls", "matmul_path", 9)])
        _write(a.json, report)
        raise SystemExit(0 if report["passed"] else 1)
    if a.large_decode_int8_roles:
        report = check_large_decode(a.large_decode_int8_roles, a.tokens, a.batch)
        print_compare_table(report, [("int8 layers", "int8_roles", 24)])
        _write(a.json, report)
        raise SystemExit(0 if all(r["passed"] for r in report["rows"]) else 1)
    if a.paths:
        report = check_paths(a.paths, a.tokens, a.seq_len, a.int8_outlier_channels)
        print_compare_table(report, [("path", "path", 18)], seconds=True)
        _write(a.json, report)
        raise SystemExit(0 if all(report["passed"].values()) else 1)
    from airserve.srt.layers.quant import block_matvec

    if not block_matvec.kernels_available():
        raise SystemExit(f"the packed kernels did not build: {block_matvec.unavailable_reason()}")
    isas = block_matvec.int8_isas() if a.all_isas else [a.isa] if a.isa else None
    activations = tuple(a.activations) + tuple(f"roles:{r}" for r in a.int8_roles)
    report = check(a.schemes, a.tokens, a.batch, isas, activations,
                   frozenset(a.auto_int8_kinds) if a.auto_int8_kinds else None,
                   frozenset(a.auto_int16_kinds) if a.auto_int16_kinds else None)
    print_table(report)
    _write(a.json, report)
    raise SystemExit(0 if report["passed"] else 1)


def _write(path: str | None, report: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
