"""The key of TorchAirRunner's on-disk compile cache (`--torchair-cache-dir`), and its folders.

torchair's own cache (`torchair.inference.cache_compile`) is keyed by the module's repr, the
compiler config and the method's name only, and a loaded cache runs without dynamo's guards
(inference/_cache_compiler.py: `get_cache_bin`, `CompiledModel.rebase`). So it cannot see a
different batch size, KV pool size or dtype, model, airserve code, torch, torch-npu or CANN
version, and would run a stale graph. Each bucket therefore gets its own folder holding
`airserve_cache_key.json` with everything below; any difference deletes the folder (with a log
line naming what changed) before torchair looks at it. Pure Python: tested on CPU.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import platform
import shutil
import sys
from dataclasses import dataclass

logger = logging.getLogger(__name__)

KEY_FILE = "airserve_cache_key.json"
# Bump when the compiled step's inputs or their order change.
CACHE_FORMAT = 1
UNKNOWN = "unknown"


@dataclass(frozen=True)
class CompileCacheKey:
    bucket: int
    kv_shape: tuple[int, ...]  # one layer's K (and V) buffer: [num_slots, kv_heads, head_dim]
    kv_dtype: str
    num_layers: int
    page_size: int
    max_blocks: int  # block-table columns
    model_path: str
    model_config_hash: str
    code_hash: str  # airserve sources the graph is traced from
    mode: str  # torchair mode
    compiler_options: str
    torch: str
    torch_npu: str
    cann: str
    format: int = CACHE_FORMAT

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["kv_shape"] = list(self.kv_shape)
        return d


def bucket_cache_dir(root: str, bucket: int) -> str:
    return os.path.join(os.path.abspath(os.path.expanduser(root)), f"decode_bs{bucket}")


def open_bucket_cache(root: str, key: CompileCacheKey) -> str:
    """The folder for `key.bucket`'s compiled graph under `root`, emptied unless it was made
    for exactly `key`. Returns the folder, which then holds the key file."""
    folder = bucket_cache_dir(root, key.bucket)
    key_file = os.path.join(folder, KEY_FILE)
    wanted = key.as_dict()
    if os.path.isdir(folder):
        stored = _read_key(key_file)
        if stored == wanted:
            logger.info("torchair compile cache for batch size %d: reusing %s", key.bucket, folder)
            return folder
        logger.warning("torchair compile cache %s is stale (%s): deleting it and compiling again",
                       folder, describe_difference(stored, wanted))
        shutil.rmtree(folder)
    os.makedirs(folder)
    tmp = key_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump(wanted, f, indent=1, sort_keys=True)
    os.replace(tmp, key_file)
    return folder


def _read_key(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def describe_difference(stored: dict | None, wanted: dict) -> str:
    if stored is None:
        return f"no readable {KEY_FILE}"
    changed = [f"{k}: {stored.get(k)!r} -> {v!r}" for k, v in sorted(wanted.items())
               if stored.get(k) != v]
    changed += [f"{k}: {stored[k]!r} -> absent" for k in sorted(set(stored) - set(wanted))]
    return "; ".join(changed)


# Pieces of the key.
def model_config_hash(config) -> str:
    """Hash of a (dataclass) model config's fields."""
    fields = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else vars(config)
    return _sha(json.dumps(fields, sort_keys=True, default=str))


def source_hash(*objects) -> str:
    """Hash of the source files defining `objects` (classes, functions or modules)."""
    h = hashlib.sha256()
    for path in sorted({inspect.getsourcefile(o) or "" for o in objects}):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def torch_npu_version() -> str:
    module = sys.modules.get("torch_npu")
    if module is not None:
        return str(getattr(module, "__version__", UNKNOWN))
    try:
        return importlib.metadata.version("torch-npu")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def cann_version(environ: dict | None = None) -> str:
    """The CANN toolkit version from the `version=` line of
    `$ASCEND_TOOLKIT_HOME/<arch>-linux/ascend_toolkit_install.info` (set by CANN's set_env.sh;
    the file torch_npu's collect_env and vllm-ascend's tools read), else torch_npu's own
    `get_cann_version()`, else "unknown"."""
    env = os.environ if environ is None else environ
    arch = platform.machine() or "x86_64"
    for var in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        home = env.get(var)
        if not home:
            continue
        for name in ("ascend_toolkit_install.info", "ascend_all_cann_install.info"):
            version = _version_line(os.path.join(home, f"{arch}-linux", name))
            if version:
                return version
    if "torch_npu" in sys.modules:
        try:
            from torch_npu.npu.utils import get_cann_version

            return str(get_cann_version()) or UNKNOWN
        except Exception:  # older torch_npu without it
            pass
    return UNKNOWN


def _version_line(path: str) -> str | None:
    try:
        with open(path) as f:
            for line in f:
                if line.strip().startswith("version="):
                    return line.strip().split("=", 1)[1]
    except OSError:
        return None
    return None
