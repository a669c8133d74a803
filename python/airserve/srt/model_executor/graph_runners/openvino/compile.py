"""torch.compile(backend="openvino") with the weights frozen and no silent fallback.

The stock backend (openvino 2026.4) hides failures: a conversion error makes it return an
inductor-compiled graph, an unsupported op leaves part of the graph in PyTorch, and a run-time
error switches a partition to eager PyTorch for good, each logged at debug level only.
`OpenVINOCompiler` wraps the stock backend, records what it produced and `verify()` raises
`OpenVINOFallbackError` with the reason unless the whole graph runs in one OpenVINO model.

It also turns the weights into constants of the OpenVINO model (dynamo passes them as graph
inputs): with constant weights the CPU plugin pre-packs them once, and a bf16/f16 precision hint
converts them at compile time instead of on every step.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
from collections.abc import Callable, Iterable, Iterator

import torch

logger = logging.getLogger(__name__)

PRECISION_HINTS = {"f32": "f32", "bf16": "bf16", "f16": "f16"}
_BACKEND_LOGGERS = ("openvino.frontend.pytorch.torchdynamo.backend",
                    "openvino.frontend.pytorch.torchdynamo.execute")


# OPTIMIZATION_CAPABILITIES a device must list to compute in a precision: without it the CPU
# plugin keeps the f32 it can do and reports f32, with no error.
PRECISION_CAPABILITY = {"bf16": "BF16", "f16": "FP16"}


def check_precision(device: str, precision: str) -> None:
    """Refuse a precision hint the device would silently ignore."""
    import openvino

    needed = PRECISION_CAPABILITY.get(precision)
    if needed is None:
        return
    caps = list(openvino.Core().get_property(device, "OPTIMIZATION_CAPABILITIES"))
    if needed not in caps:
        raise ValueError(
            f"--openvino-precision {precision}: OpenVINO's {device} device on this machine "
            f"cannot compute in {precision} (its capabilities: {', '.join(caps)}) and would run "
            "in f32 instead; use --openvino-precision f32")


class OpenVINOFallbackError(RuntimeError):
    """A graph compiled for OpenVINO would run (partly) outside OpenVINO."""


def compile_options(device: str, precision: str, num_threads: int | None,
                    cache_dir: str | None, disabled_ops: Iterable[str] = (),
                    dynamic_quant_group_size: int = 0) -> dict:
    """`options` for torch.compile(backend="openvino"): the plugin config for one decode step.

    `cache_dir` is OpenVINO's compiled-blob cache (CACHE_DIR), which skips the plugin compile on
    a restart. `dynamic_quant_group_size` is the plugin's DYNAMIC_QUANTIZATION_GROUP_SIZE: its CPU
    plugin otherwise quantizes activations to int8 in matmuls with u4/i8 weights by default
    (group 32), even under an f32 precision hint; 0 keeps them float.

    The backend's own `model_caching` stays off: in openvino 2026.4.1 a process that
    finds its cached model fails to load it (UnboundLocalError on `decoder` in
    `openvino_compile`) and the backend silently runs the graph in eager PyTorch.
    """
    config = {
        "INFERENCE_PRECISION_HINT": PRECISION_HINTS[precision],
        "PERFORMANCE_HINT": "LATENCY",  # one request at a time, lowest latency
        "NUM_STREAMS": "1",
        "DYNAMIC_QUANTIZATION_GROUP_SIZE": str(dynamic_quant_group_size),
    }
    if num_threads is not None:
        config["INFERENCE_NUM_THREADS"] = str(num_threads)
    if cache_dir is not None:
        config["CACHE_DIR"] = cache_dir
    # aot_autograd: its path turns module buffers (the frozen weights) into OpenVINO constants.
    # The graph mutates no input, so it adds no copy-back of the KV pool. (The stock backend
    # keeps the options of its last aot_autograd compile in a module global.)
    options = {"device": device, "config": config, "model_caching": False, "aot_autograd": True}
    if disabled_ops:
        options["disabled_ops"] = list(disabled_ops)
    return options


@contextlib.contextmanager
def _backend_debug_records() -> Iterator[list[logging.LogRecord]]:
    """Collect the stock backend's debug records (where it logs why it fell back)."""
    # Imported first: importing it resets its logger's level.
    import openvino.frontend.pytorch.torchdynamo.backend  # noqa: F401

    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Collect(logging.DEBUG)
    saved = []
    for name in _BACKEND_LOGGERS:
        log = logging.getLogger(name)
        saved.append((log, log.level, log.propagate))
        log.setLevel(logging.DEBUG)
        log.propagate = False
        log.addHandler(handler)
    try:
        yield records
    finally:
        for log, level, propagate in saved:
            log.removeHandler(handler)
            log.setLevel(level)
            log.propagate = propagate


_ELEMENT_TYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
                  torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8", torch.int8: "i8",
                  torch.bool: "boolean"}


def _compile_partition(gm: torch.fx.GraphModule, *args, model_hash_str=None, options=None):
    """Convert and compile one OpenVINO partition; what the stock backend's `openvino_compile`
    does with model caching off, except for symbolic sizes.

    A graph traced with a dynamic dimension (the decode graph's KV length) takes the size as an
    int input. The OpenVINO front end converts it to a scalar parameter; the stock function then
    declares every int input of shape [1] (openvino 2026.4.1,
    frontend/pytorch/torchdynamo/compile.py), which breaks validation wherever the size joins
    a shape list (a view or expand after a matmul's decomposition). Here it stays a scalar, and
    tensor inputs keep the front end's shapes, -1 where dynamo made a dimension symbolic."""
    import openvino
    from openvino.frontend import FrontEndManager
    from openvino.frontend.pytorch.fx_decoder import TorchFXPythonDecoder

    decoder = TorchFXPythonDecoder(gm)
    front_end = FrontEndManager().load_by_framework("pytorch")
    model = front_end.convert(front_end.load(decoder))
    for i, arg in enumerate(args):
        param = model.inputs[i].get_node()
        if isinstance(arg, int):
            param.set_element_type(openvino.Type.i64)
            param.set_partial_shape(openvino.PartialShape([]))
        else:
            param.set_element_type(getattr(openvino.Type, _ELEMENT_TYPES[arg.dtype]))
            param.set_partial_shape(openvino.PartialShape(list(decoder.input_shapes[i])))
    model.validate_nodes_and_infer_types()
    if _converted is not None:
        _converted.append(model)
    return openvino.Core().compile_model(model, options["device"], options["config"])


_converted: list | None = None  # while _symbolic_size_compile runs: the models it converted


@contextlib.contextmanager
def _symbolic_size_compile() -> Iterator[list]:
    """The stock backend compiles its partitions with `_compile_partition` meanwhile; yields
    the list of the OpenVINO models converted (before compilation)."""
    from openvino.frontend.pytorch.torchdynamo import execute

    global _converted
    stock = execute.openvino_compile
    execute.openvino_compile = _compile_partition
    _converted = converted = []
    try:
        yield converted
    finally:
        execute.openvino_compile = stock
        _converted = None


def _reason(records: list[logging.LogRecord]) -> str:
    failures = [r.getMessage() for r in records if "fail" in r.getMessage().lower()]
    return failures[-1].strip() if failures else "no reason logged by the openvino backend"


def _unpacks_partition(node: torch.fx.Node) -> bool:
    """`getitem` taking one output of a multi-output OpenVINO partition: no computation."""
    return (node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node)
            and node.args[0].op == "call_module")


class OpenVINOCompiler:
    """A dynamo backend for one decode graph: freezes `frozen` tensors (the model's weights) into
    constants, hands the graph to the stock "openvino" backend and keeps what it produced."""

    def __init__(self, options: dict, frozen: Iterable[torch.Tensor]) -> None:
        self.options = options
        self._frozen = {t.data_ptr(): t for t in frozen}
        self.fused = None  # the partitioned torch.fx module the stock backend runs
        self.num_constants = 0
        self.calls = 0
        self.records: list[logging.LogRecord] = []
        self.partition = None  # the OpenVINO-run submodule of `fused`, once verified
        self.input_plan: list[int | str] = []  # per model input: an input's index or a size
        self.output_order: list[int] = []  # per output of the step: OpenVINO's output index
        self.model = None  # the converted OpenVINO model (before compilation), once run

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._dynamo.backends.registry import lookup_backend

        self.calls += 1  # more than one: dynamo recompiled this graph
        # A copy: dynamo checks the module it traced against its own attribute sources.
        gm = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        keep = self._freeze(gm, example_inputs)
        compiled = lookup_backend("openvino")(gm, [example_inputs[i] for i in keep],
                                              options=self.options)

        def run(*args):
            return compiled(*[args[i] for i in keep])

        return run

    def _freeze(self, gm: torch.fx.GraphModule, example_inputs: list) -> list[int]:
        """Turn placeholders fed by frozen tensors into module constants; returns the indices of
        the inputs that stay graph inputs."""
        keep = []
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
            tensor = self._frozen.get(value.data_ptr()) if isinstance(value, torch.Tensor) else None
            if tensor is None or tensor.shape != value.shape:
                keep.append(i)
                continue
            name = f"_frozen_{self.num_constants}"
            self.num_constants += 1
            gm.register_buffer(name, tensor.detach())
            with gm.graph.inserting_before(node):
                const = gm.graph.get_attr(name)
            const.meta.update(node.meta)
            node.replace_all_uses_with(const)
            gm.graph.erase_node(node)
        gm.graph.lint()
        gm.recompile()
        return keep

    def first_run(self, fn: Callable, *args, device: str):
        """Run `fn` (torch.compile'd with this backend) for the first time, which compiles it,
        and verify the result ran in OpenVINO; returns fn's outputs."""
        from openvino.frontend.pytorch.torchdynamo import execute

        before = set(execute.partitioned_modules)
        with _backend_debug_records() as records, _symbolic_size_compile() as converted:
            try:
                out = fn(*args)
            except Exception as e:
                # E.g. the backend's inductor fallback failing after a conversion error.
                raise OpenVINOFallbackError(
                    f"OpenVINO could not compile the decode graph ({_reason(records)}; then "
                    f"{type(e).__name__}: {e})") from e
        self.records = records
        self.model = converted[0] if len(converted) == 1 else None
        # The stock backend registers the partitioned module it runs on its first call.
        new = [m for k, m in execute.partitioned_modules.items() if k not in before]
        self.fused = new[0] if len(new) == 1 else None
        self.verify(device)
        return out

    def verify(self, device: str) -> None:
        """Raise OpenVINOFallbackError unless the graph ran as one OpenVINO model on `device`.

        Call after the first run (the stock backend compiles its OpenVINO model lazily).
        """
        from openvino.frontend.pytorch.torchdynamo import execute

        if not isinstance(self.fused, torch.fx.GraphModule):
            raise OpenVINOFallbackError(
                "the openvino backend did not run the decode graph: it could not convert it and "
                f"compiled it with inductor instead ({_reason(self.records)})")
        outside = sorted({str(n.target) for n in self.fused.graph.nodes
                          if n.op in ("call_function", "call_method")
                          and not _unpacks_partition(n)})
        parts = [m for name, m in self.fused.named_children() if name.startswith("fused_")]
        if outside or len(parts) != 1:
            raise OpenVINOFallbackError(
                f"OpenVINO runs only part of the decode graph ({len(parts)} OpenVINO "
                f"partition(s)); these ops would run in PyTorch: {', '.join(outside) or 'none'}")
        part = parts[0]
        if not isinstance(part, execute.OpenVINOGraphModule):
            raise OpenVINOFallbackError("the decode graph has not run through OpenVINO yet")
        if part.perm_fallback:  # the stock backend's switch to eager after a run-time error
            raise OpenVINOFallbackError(
                "OpenVINO failed to run the decode graph and the openvino backend switched it to "
                f"eager PyTorch ({_reason(self.records)})")
        compiled = execute.compiled_cache.get(part.partition_id)
        if compiled is None:
            raise OpenVINOFallbackError("no OpenVINO compiled model for the decode graph")
        ran_on = list(compiled.get_property("EXECUTION_DEVICES"))
        if not any(d == device or d.startswith(device + ".") or device.startswith(d)
                   for d in ran_on):
            raise OpenVINOFallbackError(f"OpenVINO ran the graph on {ran_on}, not on {device}")
        self.partition = part

    def bind(self, inputs: Iterable[torch.Tensor], outputs: Iterable[torch.Tensor],
             sizes: dict[int, str] | None = None) -> None:
        """Learn how replay feeds the compiled model, from the first run: call after
        `first_run(fn, *args)` with the tensors of `args` (`inputs`), what `fn` returned
        (`outputs`) and the example value of each symbolic size (`sizes`, value -> name).

        Each model input is matched by address to the tensor the stock backend handed to
        OpenVINO, or, for a scalar input (a dynamic dimension's size), by value to a name of
        `sizes`; each output of `fn` by address to an OpenVINO output buffer. Anything that
        does not match is an OpenVINOFallbackError. `request` then binds new tensors in the
        same places."""
        from openvino.frontend.pytorch.torchdynamo import execute

        stock = execute.req_cache[self.partition.partition_id]
        inputs = list(inputs)
        by_address = {t.data_ptr(): j for j, t in enumerate(inputs)}
        sizes = sizes or {}
        plan: list[int | str] = []
        for i in range(len(stock.model_inputs)):
            fed = stock.get_input_tensor(i).data
            if fed.ndim == 0 and int(fed) in sizes:
                plan.append(sizes[int(fed)])
                continue
            j = by_address.get(fed.ctypes.data)
            if j is None:
                raise OpenVINOFallbackError(
                    f"OpenVINO model input {i} ({stock.model_inputs[i]}) is not one of the "
                    "decode step's input tensors: the graph cannot be replayed in place")
            plan.append(j)
        addresses = [stock.get_output_tensor(i).data.ctypes.data
                     for i in range(len(stock.model_outputs))]
        order = []
        for j, out in enumerate(outputs):
            if out.data_ptr() not in addresses:
                raise OpenVINOFallbackError(
                    f"output {j} of the decode step is not an OpenVINO output buffer")
            order.append(addresses.index(out.data_ptr()))
        self.input_plan, self.output_order = plan, order

    def request(self, inputs: list[torch.Tensor], sizes: dict[str, torch.Tensor] | None = None
                ) -> BoundRequest:
        """A new infer request of the compiled model reading `inputs` (ordered as `bind` was
        given them) and the 0-d int64 tensors of `sizes` in place."""
        sizes = sizes or {}
        tensors = [sizes[p] if isinstance(p, str) else inputs[p] for p in self.input_plan]
        return BoundRequest(self.compiled_model, tensors, self.output_order)

    def specialize(self, inputs: list[torch.Tensor], sizes: dict[str, int]) -> BoundRequest:
        """A request of this graph compiled again with every shape static: each symbolic size
        a constant (`sizes`, name -> value), each tensor input the shape of its tensor in
        `inputs` (ordered as `bind` was given them). No trace and no conversion, only
        OpenVINO's compile (~4 s for the default model's decode graph on 2 cores)."""
        import numpy as np
        import openvino

        if self.model is None:
            raise OpenVINOFallbackError("the converted OpenVINO model of this graph was not "
                                        "kept: it cannot be specialized")
        model = self.model.clone()
        params = list(model.get_parameters())
        plan = []
        for param, p in zip(params, self.input_plan, strict=True):
            if isinstance(p, str):
                const = openvino.op.Constant(np.array(sizes[p], dtype=np.int64))
                param.output(0).replace(const.output(0))
                model.remove_parameter(param)
                continue
            param.set_partial_shape(openvino.PartialShape(list(inputs[p].shape)))
            plan.append(p)
        model.validate_nodes_and_infer_types()
        compiled = openvino.Core().compile_model(model, self.options["device"],
                                                 self.options["config"])
        return BoundRequest(compiled, [inputs[p] for p in plan], self.output_order)

    @property
    def compiled_model(self):
        from openvino.frontend.pytorch.torchdynamo import execute

        return execute.compiled_cache[self.partition.partition_id]

    def matmul_weight_types(self) -> dict[str, int]:
        """{element type of the weights: matmul layers} in the compiled model, e.g.
        {"u4": 210, "i8": 1} for packed GGUF weights, {"f32": 211} for float32 ones."""
        types: dict[str, int] = {}
        for node in self.compiled_model.get_runtime_model().get_ops():
            info = node.get_rt_info()
            if "layerType" not in info or info["layerType"].astype(str) != "FullyConnected":
                continue
            weight = node.input(1).get_element_type().get_type_name()
            types[weight] = types.get(weight, 0) + 1
        return types

    def pool_input_consumers(self, num_slots: int) -> list[str]:
        """Layer types reading the KV-pool inputs (first dim `num_slots`) in the compiled model.

        Only gathers keep the cost per step independent of the pool size; anything else (say a
        multiply OpenVINO moved in front of a gather) touches the whole pool every step.
        """
        runtime = self.compiled_model.get_runtime_model()
        types = []
        for param in runtime.get_parameters():
            shape = param.get_output_partial_shape(0)
            if shape.rank.get_length() != 3 or shape[0].get_length() != num_slots:
                continue
            for out in param.outputs():
                for target in out.get_target_inputs():
                    info = target.get_node().get_rt_info()
                    types.append(info["layerType"].astype(str) if "layerType" in info
                                 else target.get_node().get_type_name())
        return types


class BoundRequest:
    """An OpenVINO infer request whose inputs are torch tensors shared in place: calling it runs
    the model on their current contents and returns its outputs (in the order `bind` was given)
    as tensors over OpenVINO's output buffers, valid until the next call."""

    def __init__(self, compiled_model, inputs: list[torch.Tensor], output_order: list[int]
                 ) -> None:
        import openvino

        self.request = compiled_model.create_infer_request()
        self.inputs = inputs  # kept alive: OpenVINO reads their memory
        for i, tensor in enumerate(inputs):
            self.request.set_input_tensor(i, openvino.Tensor(tensor.numpy(), shared_memory=True))
        self.output_order = output_order
        self.calls = 0

    def __call__(self) -> list[torch.Tensor]:
        self.request.infer()
        self.calls += 1
        return [torch.from_numpy(self.request.get_output_tensor(i).data)
                for i in self.output_order]
