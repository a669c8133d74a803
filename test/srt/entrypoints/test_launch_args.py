"""`python -m airserve.launch_server` argument handling (no server started)."""

from __future__ import annotations

import pytest

from airserve.launch_server import parse_args
from airserve.srt.server_args import DEFAULT_CPU_CHUNK


def refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_sglang_flag_names():
    args = parse_args(["--model-path", "/m", "--port", "31000", "--host", "0.0.0.0",
                       "--device", "cpu", "--enable-torch-compile", "--torch-compile-max-bs",
                       "8", "--cuda-graph-bs", "4", "1", "2", "--mem-fraction-static", "0.3",
                       "--max-running-requests", "4", "--served-model-name", "m",
                       "--api-key", "k", "--enable-metrics", "--skip-server-warmup",
                       "--tp-size", "1", "--trust-remote-code", "--disable-radix-cache"])
    assert args.model_path == "/m" and args.port == 31000 and args.host == "0.0.0.0"
    assert args.cuda_graph_bs == (1, 2, 4) and args.torch_compile_max_bs == 8
    assert args.served_model_name == "m" and args.api_key == "k" and args.enable_metrics
    assert args.disable_radix_cache


def test_scheduling_flags():
    args = parse_args(["--schedule-policy", "lpm", "--chunked-prefill-size", "256",
                       "--enable-mixed-chunk"])
    assert (args.schedule_policy, args.resolved_chunked_prefill_size) == ("lpm", 256)
    assert args.enable_mixed_chunk and not args.disable_radix_cache
    assert parse_args(["--chunked-prefill-size", "-1"]).resolved_chunked_prefill_size is None
    assert parse_args([]).resolved_chunked_prefill_size == DEFAULT_CPU_CHUNK
    assert parse_args([]).resolved_decode_chunked_prefill_size is None  # off by default
    args = parse_args(["--decode-chunked-prefill-size", "64"])
    assert args.resolved_decode_chunked_prefill_size == 64
    args = parse_args(["--decode-chunked-prefill-size", "-1"])
    assert args.resolved_decode_chunked_prefill_size is None


def test_defaults():
    args = parse_args([])
    assert args.model_path is None  # the default model
    assert (args.host, args.port) == ("127.0.0.1", 30000)


def test_unknown_flag_is_an_error(capsys):
    assert "unrecognized arguments: --no-such-flag" in refused(["--no-such-flag"], capsys)


def test_abbreviations_are_not_accepted(capsys):
    assert "unrecognized arguments" in refused(["--model-pa", "/m"], capsys)


def test_unsupported_sglang_flags_are_named(capsys):
    err = refused(["--pp-size", "2", "--enable-lora"], capsys)
    assert "--pp-size 2: pipeline parallelism is not supported" in err
    assert "--enable-lora: LoRA" in err


def test_kv_cache_dtype(capsys):
    import torch

    from airserve.srt.hardware import host_cpu
    from airserve.srt.layers.quant.path_choice import (
        FLOAT16_KV_PATHS,
        cpu_has_bf16,
        int8_available,
    )

    # auto: float16 where the matmuls of prefill and large batches are inexact (bf16 or float16
    # weights), else the model's.
    auto = parse_args([])
    assert set(FLOAT16_KV_PATHS) == {"bfloat16", "float16_weights"}
    expected = torch.float16 if auto.resolved_large_path in FLOAT16_KV_PATHS else torch.float32
    assert auto.resolved_kv_cache_dtype(torch.float32) == expected
    assert parse_args(["--dtype", "float32"]).resolved_kv_cache_dtype(torch.float32) == \
        torch.float32
    if cpu_has_bf16(host_cpu()[1]):
        assert parse_args(["--dtype", "bfloat16"]).resolved_kv_cache_dtype(torch.float32) == \
            torch.float16
    if int8_available():
        fp16w = parse_args(["--quantization", "float16_weights"])
        assert fp16w.resolved_kv_cache_dtype(torch.float32) == torch.float16
        # The int8 paths keep the model's dtype (their fidelity was measured over float32 KV).
        assert parse_args(["--quantization", "w8a8_int8"]).resolved_kv_cache_dtype(
            torch.float32) == torch.float32
    # The OpenVINO runner keeps a float32 pool under auto whatever the matmuls.
    ov = parse_args(["--enable-torch-compile", "--torch-compile-backend", "openvino"])
    assert ov.resolved_kv_cache_dtype(torch.float32) == torch.float32
    args = parse_args(["--kv-cache-dtype", "bfloat16", "--dtype", "float32"])
    assert args.resolved_kv_cache_dtype(torch.float32) == torch.bfloat16
    assert parse_args(["--kv-cache-dtype", "float32"]).resolved_kv_cache_dtype(
        torch.float32) == torch.float32
    assert "--kv-cache-dtype fp8_e5m2: fp8 KV caches are not implemented" in refused(
        ["--kv-cache-dtype", "fp8_e5m2"], capsys)
    assert "not implemented for the OpenVINO runner" in refused(
        ["--kv-cache-dtype", "bfloat16", "--enable-torch-compile", "--torch-compile-backend",
         "openvino"], capsys)
    # int8 rows (values + scale) are read by the C++ CPU attention only.
    assert parse_args(["--kv-cache-dtype", "int8"]).resolved_kv_cache_dtype(
        torch.float32) == torch.int8
    for flags in (["--device", "cuda"], ["--device", "npu"],
                  ["--enable-torch-compile", "--torch-compile-backend", "openvino"]):
        err = refused(["--kv-cache-dtype", "int8", *flags], capsys)
        assert "--kv-cache-dtype int8 is implemented for --device cpu" in err, (flags, err)
        assert "choose float16 or bfloat16" in err


def test_bad_values_name_the_flag(capsys):
    assert "mem_fraction_static" in refused(["--mem-fraction-static", "2"], capsys)
    assert "--device" in refused(["--device", "tpu"], capsys)
    assert "chunked_prefill_size=0" in refused(["--chunked-prefill-size", "0"], capsys)
    assert "--schedule-policy" in refused(["--schedule-policy", "lifo"], capsys)
    assert "decode_chunked_prefill_size=0" in refused(
        ["--decode-chunked-prefill-size", "0"], capsys)
    err = refused(["--chunked-prefill-size", "-1", "--decode-chunked-prefill-size", "64"], capsys)
    assert "needs chunked prefill" in err
    err = refused(["--chunked-prefill-size", "64", "--decode-chunked-prefill-size", "100"], capsys)
    assert "exceeds chunked_prefill_size=64" in err


def test_tensor_parallel_flags(capsys):
    args = parse_args(["--tp-size", "4", "--nnodes", "2", "--node-rank", "1",
                       "--dist-init-addr", "10.0.0.1:5000", "--dist-timeout", "60"])
    assert (args.tp_size, args.nnodes, args.node_rank) == (4, 2, 1)
    assert args.dist_init_addr == "10.0.0.1:5000" and args.dist_timeout == 60
    assert parse_args(["--tensor-parallel-size", "2"]).tp_size == 2
    for argv, why in ((["--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "h:1"],
                       "multiple of nnodes"),
                      (["--tp-size", "2", "--nnodes", "2"], "--dist-init-addr"),
                      (["--tp-size", "2", "--nnodes", "2", "--node-rank", "2",
                        "--dist-init-addr", "h:1"], "node_rank=2"),
                      (["--tp-size", "2", "--dist-init-addr", "nohost"], "HOST:PORT"),
                      (["--tp-size", "2", "--dp-size", "2", "--nnodes", "2",
                        "--dist-init-addr", "h:1"], "SGLang's router")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert why in capsys.readouterr().err


def test_matmul_path_flags(capsys):
    from airserve.srt.layers.quant.matmul_paths import int8_available

    if int8_available():
        args = parse_args(["--quantization", "w8a8_int8"])
        assert (args.quantization, args.resolved_large_path) == ("w8a8_int8", "w8a8_int8")
    assert parse_args(["--dtype", "float32"]).resolved_large_path == "float32"
    if int8_available():
        args = parse_args(["--quantization", "w8a8_int8_outliers",
                           "--int8-outlier-channels", "8"])
        assert (args.resolved_large_path, args.int8_outlier_channels) == (
            "w8a8_int8_outliers", 8)
    assert "--quantization" in refused(["--quantization", "fp8"], capsys)


def test_default_page_size_per_device():
    # cpu: 16-slot pages keep a request's decode tokens together for the C++ attention; the
    # OpenVINO runner keeps pages of one slot; npu: FIA's 128; the flag wins everywhere.
    assert parse_args([]).resolved_page_size == 16
    assert parse_args(["--enable-torch-compile", "--torch-compile-backend",
                       "openvino"]).resolved_page_size == 1
    assert parse_args(["--device", "cuda"]).resolved_page_size == 1
    assert parse_args(["--device", "npu"]).resolved_page_size == 128
    assert parse_args(["--page-size", "1"]).resolved_page_size == 1
