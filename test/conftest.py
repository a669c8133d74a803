"""Shared fixtures: tiny random-weight models saved as HF directories, built in code."""

from __future__ import annotations

import json

import pytest
import torch

from airserve_testing.tiny_models import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> str:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


__all__ = ["json", "make_tiny_model_dir"]
