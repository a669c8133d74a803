"""Compiled decode buckets on disk, so a restart loads what an earlier start compiled.

Layout: `<compile cache dir>/cpu-graphs/<key>/` holds `key.json` (what the key was made of),
per compiled graph `graph-<sha256 prefix>.bin` (inductor's compiled artifact: the AOTAutograd
and FX graph cache entries, loaded back without dynamo; one graph may serve several buckets)
and per bucket `bs<N>.json` (its manifest: which artifact, its sha256, and where each graph
input comes from, the batch size of a shared graph among them). The key hashes everything that
changes the traced graphs: the model files (size and mtime), the flags that change shapes or
code paths, torch, the CPU's instruction sets and airserve's version. The graph's inputs are
named (a weight's parameter name, a KV buffer, a static batch field) with the view taken of
them, and rebuilt from the new process's tensors at load; a name, shape or layout that no longer
matches, a checksum that fails or an artifact that does not load makes the bucket stale: the
runner recompiles it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterator

import torch

import airserve
from airserve.srt.hardware import host_cpu
from airserve.srt.layers.linear import OPAQUE_WEIGHTS

FORMAT = 5  # bump when the manifest's layout changes


class StaleBucket(Exception):
    """A stored bucket that cannot be used (missing, corrupt, or made for other tensors)."""


def model_identity(model_path: str | None) -> list:
    """Name, size and mtime of the model file, or of every file of a model directory."""
    from airserve.srt.model_loader.loader import resolve_model_path

    path = os.path.abspath(resolve_model_path(model_path))
    files = ([os.path.join(path, f) for f in sorted(os.listdir(path))]
             if os.path.isdir(path) else [path])
    return [path] + [[os.path.basename(f), os.stat(f).st_size, os.stat(f).st_mtime_ns]
                     for f in files if os.path.isfile(f)]


def cache_key_parts(model_path: str | None, graph_flags: str, extra: dict) -> dict:
    """Everything the compiled graphs depend on besides the tensors' shapes (checked per input).
    `kernels`: the C++ operators' build name, a hash of their sources: a graph calls them with
    the argument lists of its build (packed_or_large_1 once took strings where it takes codes),
    so other sources are another store even at the same airserve version."""
    from airserve.srt.layers import cpu_kernels

    return {
        "format": FORMAT, "airserve": airserve.__version__, "torch": torch.__version__,
        "kernels": cpu_kernels.build_name(),
        "cpu": sorted(host_cpu()[1]), "model": model_identity(model_path),
        "flags": graph_flags, **extra,
    }


def named_tensors(roots: dict[str, object]) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors reachable from `roots` in a fixed order: a module's parameters and buffers, then
    tensor attributes (and tensors in list/tuple/dict attributes) of the other objects."""
    for prefix, obj in roots.items():
        if isinstance(obj, torch.nn.Module):
            yield from ((f"{prefix}.{n}", t) for n, t in obj.named_parameters())
            yield from ((f"{prefix}.{n}", t) for n, t in obj.named_buffers())
            continue
        if dataclasses.is_dataclass(obj):
            fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        else:
            fields = vars(obj) if hasattr(obj, "__dict__") else {}
        for name, value in sorted(fields.items()):
            items = (value.items() if isinstance(value, dict)
                     else enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)])
            for i, v in items:
                if isinstance(v, torch.Tensor):
                    yield (f"{prefix}.{name}" if i is None else f"{prefix}.{name}.{i}"), v


def weight_handles(roots: dict[str, object]) -> dict[str, int]:
    """The handle of every weight a layer holds outside its tensors (`OPAQUE_WEIGHTS`), by module
    name and attribute: the compiled code holds these handles as constants."""
    handles = {}
    for prefix, obj in roots.items():
        if isinstance(obj, torch.nn.Module):
            for name, module in obj.named_modules():
                for attr in OPAQUE_WEIGHTS:
                    weight = getattr(module, attr, None)
                    if weight is not None:
                        handles[f"{prefix}.{name}.{attr}"] = weight.handle
    return handles


def layer_forms(roots: dict[str, object]) -> dict[str, list]:
    """How each linear layer multiplies, by module name: its large path, its packed row limit,
    each packed kind's decode activations and whether its large decode batches take
    int8_blocks. A traced graph bakes these in as code (the
    operators' integer codes), and they can change while every flag stays the same: `auto`
    resolves the activations by rules (block_matvec.AUTO_INT8_ROLES) that another airserve
    build may draw otherwise."""
    from airserve.srt.layers.linear import Linear

    forms = {}
    for prefix, obj in roots.items():
        if isinstance(obj, torch.nn.Module):
            for name, m in obj.named_modules():
                if isinstance(m, Linear):
                    forms[f"{prefix}.{name}"] = [
                        m.large_path, m.packed_max_rows,
                        [[k, m.activations_for(k, True)] for k in m.packed_kinds],
                        m.large_int8]
    return forms


class TensorIndex:
    """Graph inputs by name: each tensor's storage maps to the first name holding it."""

    def __init__(self, roots: dict[str, object]) -> None:
        self.by_name: dict[str, torch.Tensor] = {}
        self.by_storage: dict[int, str] = {}
        for name, t in named_tensors(roots):
            self.by_name.setdefault(name, t)
            self.by_storage.setdefault(t.untyped_storage().data_ptr(), name)
        self.handles = weight_handles(roots)
        self.forms = layer_forms(roots)

    def describe(self, arg: object) -> dict:
        """A manifest entry for one graph input; KeyError if it is not a known tensor's view."""
        if not isinstance(arg, torch.Tensor):
            if arg is None or isinstance(arg, (bool, int, float)):
                return {"value": arg}
            raise KeyError(f"graph input of type {type(arg).__name__}")
        name = self.by_storage.get(arg.untyped_storage().data_ptr())
        if name is None or self.by_name[name].dtype != arg.dtype:
            raise KeyError(f"graph input {tuple(arg.shape)} {arg.dtype} has no name")
        return {"name": name, "shape": list(arg.shape), "stride": list(arg.stride()),
                "offset": arg.storage_offset(), "dtype": str(arg.dtype),
                "base_shape": list(self.by_name[name].shape)}

    def rebuild(self, spec: dict) -> object:
        """The graph input `spec` describes, as a view of this process's tensor."""
        if "value" in spec:
            return spec["value"]
        base = self.by_name.get(spec["name"])
        if base is None or str(base.dtype) != spec["dtype"]:
            raise StaleBucket(f"no tensor {spec['name']} of dtype {spec['dtype']}")
        # A KV pool or table of another size holds other slots than the graph was compiled on.
        if list(base.shape) != spec["base_shape"]:
            raise StaleBucket(f"{spec['name']} is {list(base.shape)}, the stored graph's is "
                              f"{spec['base_shape']}")
        end = spec["offset"] + sum((n - 1) * s for n, s in zip(spec["shape"], spec["stride"]))
        if end >= base.untyped_storage().nbytes() // base.element_size():
            raise StaleBucket(f"{spec['name']} is smaller than the stored graph's view")
        return base.as_strided(spec["shape"], spec["stride"], spec["offset"])


class BucketStore:
    """One directory of compiled buckets for one cache key."""

    def __init__(self, cache_dir: str, key_parts: dict) -> None:
        blob = json.dumps(key_parts, sort_keys=True, default=str)
        self.key = hashlib.sha256(blob.encode()).hexdigest()[:24]
        self.dir = os.path.join(os.path.abspath(os.path.expanduser(cache_dir)), "cpu-graphs",
                                self.key)
        os.makedirs(self.dir, exist_ok=True)
        with open(os.path.join(self.dir, "key.json"), "w") as f:
            f.write(blob)

    def manifest_path(self, bs: int) -> str:
        return os.path.join(self.dir, f"bs{bs}.json")

    def has(self, bs: int) -> bool:
        return os.path.exists(self.manifest_path(bs))

    def save_artifact(self, artifact: object) -> str:
        """Write a compiled graph; returns its file name (named by its checksum)."""
        tmp = os.path.join(self.dir, f"graph.{os.getpid()}.tmp")
        artifact.save(path=tmp, format="binary")
        name = f"graph-{file_sha256(tmp)[:24]}.bin"
        os.replace(tmp, os.path.join(self.dir, name))
        return name

    def save(self, bs: int, artifact_name: str, args: tuple, index: TensorIndex) -> None:
        """Write bucket `bs`'s manifest (which makes it visible) for the stored graph
        `artifact_name` called on `args`. Raises KeyError/RuntimeError when the graph's inputs
        cannot be named."""
        specs = [index.describe(a) for a in args]
        art_path = os.path.join(self.dir, artifact_name)
        manifest = {"artifact": artifact_name, "inputs": specs, "handles": index.handles,
                    "forms": index.forms, "sha256": file_sha256(art_path)}
        man_path = self.manifest_path(bs)
        tmp = f"{man_path}.{os.getpid()}.tmp"  # starts sharing the directory never collide
        with open(tmp, "w") as f:
            json.dump(manifest, f)
        os.replace(tmp, man_path)

    def load(self, bs: int, index: TensorIndex,
             loaded: dict[str, Callable] | None = None) -> tuple[Callable, tuple]:
        """Bucket `bs`'s compiled graph and its inputs rebuilt from `index`; StaleBucket if the
        stored bucket cannot be used. `loaded` holds the graphs loaded so far by file name
        (buckets sharing a graph load it once)."""
        loaded = {} if loaded is None else loaded
        try:
            with open(self.manifest_path(bs)) as f:
                manifest = json.load(f)
            specs, name = manifest["inputs"], manifest["artifact"]
            art_path = os.path.join(self.dir, os.path.basename(name))
            if name not in loaded and file_sha256(art_path) != manifest["sha256"]:
                raise StaleBucket(f"{os.path.basename(art_path)} fails its checksum")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StaleBucket(f"unreadable manifest or artifact ({type(e).__name__}: {e})") from e
        # Handles are numbered in load order: another process (or a second model in this one)
        # may give a layer another number, and the stored graph would read the wrong weight.
        if manifest.get("handles") != index.handles:
            raise StaleBucket("the layers' weight handles differ from the stored graph's")
        if manifest.get("forms") != index.forms:
            raise StaleBucket("the layers' matmul paths or decode activations differ from the "
                              "stored graph's")
        args = tuple(index.rebuild(s) for s in specs)
        if name not in loaded:
            from torch._inductor import CompiledArtifact

            try:
                loaded[name] = CompiledArtifact.load(path=art_path, format="binary")
            except Exception as e:  # the checksum passed: another torch or a broken cache
                raise StaleBucket(f"artifact does not load ({type(e).__name__}: {e})") from e
        return loaded[name], args


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
