"""Owns the model, the KV memory and the decode graph runner; runs one forward pass."""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Sequence

import torch

from airserve.srt.configs import ModelConfig
from airserve.srt.distributed.errors import TensorParallelError
from airserve.srt.distributed.parallel_state import (
    SINGLE,
    TPGroup,
    init_tp_group,
    select_device,
)
from airserve.srt.distributed.sharding import local_kv_heads
from airserve.srt.forward_batch import ForwardBatch, ForwardMode, KVCache
from airserve.srt.hardware import check_device
from airserve.srt.layers.attention.registry import create_attention_backend
from airserve.srt.layers.attention.torch_native_backend import attention_isa, cpp_decode_runs
from airserve.srt.mem_cache.memory_pool import (
    PagedAllocator,
    ReqToTokenPool,
    TokenToKVPool,
)
from airserve.srt.model_executor.graph_runners.config import RunnerConfig
from airserve.srt.model_executor.graph_runners.registry import create_graph_runner
from airserve.srt.model_executor.tp_worker import (
    STOP,
    ControlChannel,
    check_ranks,
    describe,
    device_index,
    resolve_init_addr,
    spawn_local_ranks,
)
from airserve.srt.model_loader.loader import load_model
from airserve.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Host cores gain nothing from decode batches beyond the CPU graph runner's largest bucket
# (--torch-compile-max-bs, 32); accelerators batch wider.
DEFAULT_MAX_RUNNING_REQUESTS = {"cpu": 32, "cuda": 128, "npu": 128}
# Without --max-total-tokens the KV pool holds every running request at this many tokens
# (prompt + output, a chat turn), and always one request at the full context length.
DEFAULT_KV_TOKENS_PER_REQUEST = 512


class ModelRunner:
    def __init__(self, server_args: ServerArgs, model_config: ModelConfig | None = None,
                 model: torch.nn.Module | None = None, tp_rank: int = 0) -> None:
        self.server_args = args = server_args
        self.device = args.device
        self.runner_config = RunnerConfig.from_server_args(args)  # all a graph runner reads
        check_device(args.device)
        select_device(args.device, device_index(args, tp_rank))  # cuda/npu: this rank's own
        if args.num_threads is not None and self.device == "cpu":
            torch.set_num_threads(args.num_threads)
        torch.manual_seed(args.random_seed)
        self.tp_procs: list = []  # rank 0: this machine's other ranks' processes
        self.tp = self._init_tp(tp_rank)
        if model is None:
            logger.info("loading the model from %s%s", args.model_path or "the default package",
                        " (and airserve's C++ CPU kernels: built on first use, ~15 s, cached "
                        "under ~/.cache/torch_extensions)" if self.device == "cpu" else "")
            model_config, model = load_model(args.model_path, args.dtype, self.device,
                                             args.context_length,
                                             args.resolved_packed_decode_max_bs,
                                             args.openvino_packed_weights,
                                             args.cpu_decode_activations, tp=self.tp,
                                             large_path=args.resolved_large_path,
                                             float32_matmul=args.resolved_float32_matmul,
                                             int8_outlier_channels=args.int8_outlier_channels,
                                             large_activations=args.cpu_large_activations)
        self.model_config = model_config
        self.model = model
        self.dtype = next(model.parameters()).dtype
        self.kv_dtype = args.resolved_kv_cache_dtype(self.dtype)
        self.context_len = args.context_length or model_config.max_position_embeddings
        self.fallback_counts: Counter[str] = Counter()
        self.graph_replays = 0  # decode steps served by the graph runner
        self._init_memory()
        self.attn_backend = create_attention_backend(
            args.resolved_attention_backend, self.allocator, self.context_len)
        logger.info("preparing the decode graph runner (compiles and captures graphs when one "
                    "is selected; minutes on first use)")
        self.graph_runner = create_graph_runner(self)

    # Memory.
    def _init_memory(self) -> None:
        args, cfg = self.server_args, self.model_config
        page = args.resolved_page_size
        # This rank's KV heads (all of them at tp size 1).
        kv_heads = local_kv_heads(cfg.num_key_value_heads, self.tp.size)
        per_token = TokenToKVPool.bytes_per_token(cfg.num_hidden_layers, kv_heads,
                                                  cfg.head_dim, self.kv_dtype)
        max_running = args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS[self.device]
        tokens, self.kv_pool_sized_by = self._kv_pool_tokens(per_token, max_running, page)
        if self.tp.size > 1:  # every rank holds the same slots: the smallest pool of them
            tokens = self._tp_min(tokens)
        num_pages = -(-tokens // page) + 1  # + the reserved dummy page
        max_blocks = -(-self.context_len // page)
        self.max_running_requests = max_running
        self.req_to_token_pool = ReqToTokenPool(max_running + 1, max_blocks * page, self.device)
        self.kv_pool = TokenToKVPool(cfg.num_hidden_layers, num_pages, page,
                                     kv_heads, cfg.head_dim, self.kv_dtype,
                                     self.device)
        self.allocator = PagedAllocator(self.req_to_token_pool, num_pages, page)
        self.kv_cache = KVCache(self.kv_pool.k_buffers, self.kv_pool.v_buffers, page)
        logger.info("KV pool: %d tokens in %d pages of %d (%.2f GiB, %s), sized by %s; "
                    "context %d, %d running requests at most (--max-total-tokens, "
                    "--max-running-requests change them)", (num_pages - 1) * page,
                    num_pages - 1, page, self.kv_pool.memory_bytes() / 2**30,
                    str(self.kv_dtype).removeprefix("torch."), self.kv_pool_sized_by,
                    self.context_len, max_running)

    def _kv_pool_tokens(self, per_token: int, max_running: int, page: int) -> tuple[int, str]:
        """Tokens for the KV pool and what decided them: the flag, else every running request
        at DEFAULT_KV_TOKENS_PER_REQUEST (at least one full context), capped by memory."""
        args = self.server_args
        if args.max_total_tokens is not None:
            return args.max_total_tokens, "--max-total-tokens"
        wanted = max(self.context_len,
                     max_running * min(self.context_len, DEFAULT_KV_TOKENS_PER_REQUEST))
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # Weights reordered for oneDNN are held outside the parameters.
        weights += sum(m.weight_onednn.nbytes for m in self.model.modules()
                       if getattr(m, "weight_onednn", None) is not None)
        budget = args.resolved_mem_fraction_static * self._total_memory() - weights
        fits = int(budget // per_token)
        if fits < page * 2:
            raise RuntimeError(
                f"no memory left for the KV cache ({budget / 2**20:.0f} MiB after weights); "
                "raise --mem-fraction-static or set --max-total-tokens"
            )
        if fits < wanted:
            return fits, "memory (--mem-fraction-static)"
        return wanted, (f"{max_running} running requests x "
                        f"{min(self.context_len, DEFAULT_KV_TOKENS_PER_REQUEST)} tokens, "
                        "at least one full context")

    def _total_memory(self) -> int:
        if self.device == "cuda":
            return torch.cuda.mem_get_info()[1]
        if self.device == "npu":
            return torch.npu.mem_get_info()[1]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    # Batches.
    def make_forward_batch(self, mode: ForwardMode, *, input_ids: Sequence[int],
                           positions: Sequence[int], req_pool_indices: Sequence[int],
                           seq_lens: Sequence[int], out_cache_loc: torch.Tensor,
                           extend_seq_lens: Sequence[int] | None = None,
                           extend_prefix_lens: Sequence[int] | None = None,
                           last_token_indices: Sequence[int] | None = None,
                           return_all_logits: bool = False,
                           logit_rows: Sequence[int] | None = None,
                           logit_counts: Sequence[int] | None = None) -> ForwardBatch:
        dev = self.device

        def t(values, dtype):
            return torch.tensor(list(values), dtype=dtype, device=dev)

        return ForwardBatch(
            forward_mode=mode,
            batch_size=len(req_pool_indices),
            input_ids=t(input_ids, torch.int64),
            positions=t(positions, torch.int64),
            req_pool_indices=t(req_pool_indices, torch.int64),
            seq_lens=t(seq_lens, torch.int32),
            seq_lens_cpu=list(seq_lens),
            out_cache_loc=out_cache_loc.to(dev),
            kv_cache=self.kv_cache,
            extend_seq_lens_cpu=list(extend_seq_lens) if extend_seq_lens is not None else None,
            extend_prefix_lens_cpu=(list(extend_prefix_lens)
                                    if extend_prefix_lens is not None else None),
            last_token_indices=(t(last_token_indices, torch.int64)
                                if last_token_indices is not None else None),
            return_all_logits=return_all_logits,
            logit_rows=t(logit_rows, torch.int64) if logit_rows is not None else None,
            logit_counts_cpu=list(logit_counts) if logit_counts is not None else None,
        )

    # Tensor parallelism.
    def _init_tp(self, rank: int) -> TPGroup:
        """Join the tensor-parallel group (rank 0 first starts this machine's other ranks)."""
        args = self.server_args
        if args.tp_size == 1:
            return SINGLE
        if args.uses_openvino:
            raise ValueError("--tp-size > 1 does not work with the OpenVINO graph runner (its "
                             "graphs hold no collectives); use --torch-compile-backend inductor "
                             "or run eager")
        if rank == 0:
            args = self.server_args = resolve_init_addr(args)
            self.tp_procs = spawn_local_ranks(args)
        tp = init_tp_group(self.device, rank, args.tp_size, f"tcp://{args.dist_init_addr}",
                           args.dist_timeout)
        self.tp_control = ControlChannel()
        return tp

    def _tp_min(self, value: int) -> int:
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp_control.group)
        return int(t.item())

    def shutdown(self) -> None:
        """Rank 0: tell the other ranks to stop, wait for this machine's, leave the group."""
        if self.tp.size == 1 or self.tp.rank != 0:
            return
        import torch.distributed as dist

        try:
            self.tp_control.send(STOP)
        except Exception as e:  # noqa: BLE001 - a rank already gone cannot be told
            logger.warning("could not tell the tensor parallel ranks to stop: %s", e)
        for proc in self.tp_procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
        dist.destroy_process_group()
        self.tp = SINGLE

    def check_tp_ranks(self) -> None:
        """Raise TensorParallelError if one of this machine's other ranks has exited."""
        check_ranks(self.tp_procs)

    # Forward.
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [rows, vocab] float32 (see `forward_local`); under tensor parallelism rank 0
        first hands the batch to the other ranks, and any failure is a TensorParallelError."""
        if self.tp.size == 1:
            return self.forward_local(fb)
        check_ranks(self.tp_procs)
        try:
            self.tp_control.send(describe(fb, self.allocator.req_to_token))
            return self.forward_local(fb)
        except Exception as e:
            raise TensorParallelError(
                f"a tensor parallel forward pass failed ({type(e).__name__}: {e}); the ranks "
                "are out of step, so the server stops") from e

    @torch.inference_mode()
    def forward_local(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [rows, vocab] float32: the graph runner's replay for decode when it can run
        the batch, otherwise eager (each eager decode is counted by reason)."""
        if fb.forward_mode.is_decode() and self.graph_runner is not None:
            reason = self.graph_runner.fallback_reason(fb)
            if reason is None:
                self.graph_replays += 1
                return self.graph_runner.replay(fb)
            self._count_fallback(reason)
        return self.forward_eager(fb)

    @torch.inference_mode()
    def forward_eager(self, fb: ForwardBatch) -> torch.Tensor:
        fb.attn_backend = self.attn_backend
        self.attn_backend.init_forward_metadata(fb)
        return self.model(fb.input_ids, fb.positions, fb)

    def kernels_report(self) -> dict:
        """Which decode kernels this model uses: packed GGUF weights (up to which batch size,
        how many layers of each kind), C++ decode attention, and why not where not."""
        from airserve.srt.layers import cpu_kernels
        from airserve.srt.layers.linear import Linear, matmul_path_report, packed_report

        named = [(n, m) for n, m in self.model.named_modules() if isinstance(m, Linear)]
        layers = [m for _, m in named]
        packed = [m for m in layers if m.packed_kinds and m.packed_max_rows]
        # Block segments by kind (a merged q/k/v layer may hold two kinds).
        kinds = Counter(kind for m in packed for kind in m.packed_kinds)
        report = {
            "packed_decode_max_bs": max((m.packed_max_rows for m in packed), default=0),
            "packed_layers": dict(kinds),
            "linear_layers": len(layers),
            "decode_weight_mib_bs1": round(self.model.decode_weight_bytes(1) / 2**20, 1),
            # The backend decided at creation; its decode op also needs float32 q and KV.
            "cpp_decode_attention": cpp_decode_runs(self.device, self.dtype, self.kv_dtype,
                                                    self.attn_backend.cpp_built),
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
        }
        if report["cpp_decode_attention"]:
            report["decode_attention_isa"] = attention_isa()
        report.update(packed_report(layers))
        report["matmul_paths"] = matmul_path_report(layers, [n for n, _ in named])
        if cpu_kernels.unavailable_reason():
            report["cpu_kernels_error"] = cpu_kernels.unavailable_reason()
        return report

    def _count_fallback(self, reason: str) -> None:
        if reason not in self.fallback_counts:
            logger.warning("decode batch ran eager, not in the graph runner: %s "
                           "(logged once per reason; counted in fallback_counts)", reason)
        self.fallback_counts[reason] += 1
