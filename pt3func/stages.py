"""The stages of a jitted step, as in JAX: `Jitted` -> `Lowered` -> `Compiled`; each can be printed."""

from __future__ import annotations

import warnings
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from pt3func import analysis, tree
from pt3func._compat import inductor_output_code
from pt3func.config import config
from pt3func.errors import DonationError, TracingError
from pt3func.passes.donation import DonationPlan
from pt3func.runtime import virtual
from pt3func.runtime.backend import compile_program
from pt3func.runtime.cudagraphs import CUDAGraphRunner, check_capturable
from pt3func.runtime.donated import invalidate, refuse_inference_donation
from pt3func.runtime.rank_generators import drawing_as_rank, draws_random
from pt3func.sharding.mesh import get_mesh
from pt3func.spmd.lower import place_plain_output
from pt3func.trace.module_modes import NO_WATCH, static_module_modes
from pt3func.trace.signature import (
    ArgSpec,
    leaf_key,
    leaf_key_changes,
    leaf_labels,
    split_static,
    static_key,
    static_types,
)


@dataclass
class Program:
    """A traced, lowered step and how its flat inputs and outputs map back to the user's pytrees."""

    name: str
    graph_module: fx.GraphModule
    treedef: Any  # of (dynamic args, dynamic kwargs)
    static: tuple  # as a cache key holds it (`static_key`: a module weakly, or the program would keep it alive)
    input_labels: list[str]  # per call leaf
    input_leaf_kind: list[str]  # per call leaf: "tensor" | "dtensor" | "scalar" | "static"
    scalar_dtypes: dict[int, torch.dtype]  # call leaf index -> dtype it is traced as
    graph_input_leaves: list[int]  # call leaf index of each graph input
    out_treedef: Any
    out_labels: list[str]
    out_constants: dict[int, Any]  # output leaf index -> Python value
    graph_output_leaves: list[int]  # output leaf index of each graph output, after donation
    donation: DonationPlan
    donated_leaves: list[int]  # call leaf indices the user donated
    backend: str
    scalar_device: torch.device
    spec: ArgSpec
    key: Any
    dtensor_out: dict[int, Any] = field(default_factory=dict)  # output leaf index -> DTensorMeta
    # output leaf index -> (NamedSharding, path): a plain output that out_shardings places (each rank its block)
    plain_out_shardings: dict[int, Any] = field(default_factory=dict)
    notes: dict[fx.Node, str] = field(default_factory=dict)
    cuda_graphs: bool = False  # run by replaying a CUDA graph (runtime/cudagraphs.py)
    # The rest of the Jitted's signature, which `Compiled.__call__` checks too: the dicts' key orders
    # (`dict_orders`), the modes of modules given as static arguments (`static_module_modes`), and the modules the
    # trace called with their modes and hooks then: (ModuleWatch, its modes()).
    orders: tuple = ()
    static_modes: tuple = ()
    modules: tuple = (NO_WATCH, ())

    def graph_input_labels(self) -> list[str]:
        return [self.input_labels[i] for i in self.graph_input_leaves]

    def graph_output_labels(self) -> list[str]:
        return [self.out_labels[j] for j in self.graph_output_leaves]


class Lowered:
    """A step traced and lowered for one input signature; not yet compiled."""

    def __init__(self, program: Program, example_inputs: Sequence[torch.Tensor]):
        self._program = program
        self._example_inputs = list(example_inputs)
        self._compiled: Compiled | None = None  # set once compiled (here or by the Jitted's cache)
        # Set by pf.jit where an exchange guard applies (pt3func/compress/guard.py): given this program compiled,
        # the switch that times it against the reference program and runs the one it keeps.
        self._make_switch: Callable[[Compiled], Any] | None = None
        # Lowered in a virtual mesh's rank thread: (world, rank). That thread owns the process groups its collectives
        # name, so it compiles there (Inductor resolves them).
        self._virtual: tuple[Any, int] | None = None
        # Rank 0's Lowered that `Jitted.lower` hands the caller of a virtual mesh: every rank's Lowered of that one
        # job (`pair_rank_lowerings`), so that its Compiled runs each rank's own program. Paired by the job itself:
        # pairing the n-th Lowered of each rank thread ran another step's program on a rank that had lowered once
        # more than the others (a retrace on one rank only).
        self._ranks: list[Lowered] | None = None
        self._mesh = get_mesh()  # the mesh the step was lowered under: where Compiled places plain arguments
        world = getattr(virtual._LOCAL, "world", None)
        if world is not None:
            self._virtual = (world, virtual._LOCAL.rank)

    def __reduce_ex__(self, protocol: Any) -> Any:  # pickle, copy.copy and copy.deepcopy
        raise _refuse_copy(self)

    @property
    def graph_module(self) -> fx.GraphModule:
        """The per-device program as an FX GraphModule of aten ops (do not mutate it)."""
        return self._program.graph_module

    def as_text(self) -> str:
        """The per-device program, one op a line, with the user's source line of each op."""
        p = self._program
        donated = {
            gi: "donated -> " + p.out_labels[j]
            for j, i in p.donation.aliases.items()
            for gi, leaf in enumerate(p.graph_input_leaves)
            if leaf == i
        }
        text = analysis.program_text(
            p.graph_module, p.name, p.graph_input_labels(), p.graph_output_labels(), donated, p.notes
        )
        return text

    def cost_analysis(self) -> dict[str, Any]:
        """`flops` of one call (forward, backward and update) and `comm_bytes` per collective kind."""
        gm = self._program.graph_module
        return {"flops": analysis.flops(gm), "comm_bytes": analysis.comm_bytes(gm)}

    def memory_analysis(self) -> dict[str, int]:
        """Bytes of arguments, outputs, donated buffers, temporaries and peak, before compilation.

        A liveness bound over the traced program (see `analysis.memory_analysis`); after `compile()`,
        `Compiled.memory_analysis()` reads the compiled program's own buffers and is much closer.
        """
        p = self._program
        return analysis.memory_analysis(p.graph_module, _aliased_graph_inputs(p))

    def saved_activations(self) -> list[dict[str, Any]]:
        """What the forward keeps for the backward: name, type, bytes, the op (or argument) and source line."""
        p = self._program
        return analysis.saved_activations(p.graph_module, p.graph_input_labels())

    def donation_report(self) -> list[dict[str, Any]]:
        """One row per donated leaf: its label, whether its buffer is reused, for which output, or why not."""
        p = self._program
        by_input = {i: j for j, i in p.donation.aliases.items()}
        rows = []
        for i in p.donated_leaves:
            row = {"input": p.input_labels[i], "aliased": i in by_input}
            if i in by_input:
                row["output"] = p.out_labels[by_input[i]]
            else:
                row["reason"] = p.donation.unused.get(i, "not a tensor")
            rows.append(row)
        return rows

    def compile(self) -> Compiled:
        """Compile with the chosen backend (Inductor compiles here, once; later calls return that result)."""
        if self._compiled is not None:
            return self._compiled
        if self._virtual is not None and not virtual.in_rank_thread():
            world, rank = self._virtual
            return world.run(lambda r: self.compile() if r == rank else None)[rank]
        p = self._program
        examples = self._example_inputs
        if examples is None:  # released after an earlier compile: rebuild from the traced metadata
            examples = [
                torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                for v in (n.meta["val"] for n in p.graph_module.graph.nodes if n.op == "placeholder")
            ]
        scalar_inputs = {gi: p.scalar_dtypes[i] for gi, i in enumerate(p.graph_input_leaves) if i in p.scalar_dtypes}
        if p.cuda_graphs:  # refuse before the long compile
            device = check_capturable(p.name, p.graph_module, examples, p.graph_input_labels(), list(scalar_inputs))
        with inductor_output_code() as sources:
            runner = compile_program(p.graph_module, examples, p.backend)
        if p.cuda_graphs:
            runner = CUDAGraphRunner(runner, p.name, device, _aliased_graph_inputs(p), scalar_inputs)
        # Holding the example arguments would keep the caller's first batch (and old buffers) alive.
        self._example_inputs = None
        programs = [src for src in sources if "def call(" in src]
        self._compiled = Compiled(self, runner, programs[-1] if len(programs) == 1 else None)
        if self._make_switch is not None:
            self._compiled._switch = self._make_switch(self._compiled)
            self._make_switch = None  # the switch alone holds the reference program: freed if compression is kept
        return self._compiled


class Compiled:
    """A compiled step for one input signature: call it like the original function."""

    def __init__(
        self, lowered: Lowered, runner: Callable[..., Sequence[torch.Tensor]], wrapper_source: str | None = None
    ):
        self.lowered = lowered
        self._runner = runner
        self._graphed = isinstance(runner, CUDAGraphRunner)
        # (a virtual rank runs such a program drawing from its own generator, `rank_generators`)
        self._draws_random = draws_random(lowered._program.graph_module)
        self._wrapper_source = wrapper_source  # Inductor's generated Python for the program, if compiled by it
        self._memory: dict[str, int] | None = None
        p = lowered._program
        self._program = p
        self._aliased_input_of = {j: p.graph_input_leaves.index(i) for j, i in p.donation.aliases.items()}
        self._invalidate = [i for i in p.donated_leaves if i in p.donation.donated_inputs]
        self._invalidated = frozenset(self._invalidate)
        self._output_keys: list[Any] | None = None
        # Positions in the program's inputs of the call's tensor leaves, when every tensor leaf is an input: the
        # donation overlap check then reads the unwrapped inputs only.
        tensor_leaves = [i for i, kind in enumerate(p.input_leaf_kind) if kind in ("tensor", "dtensor")]
        position = {leaf: k for k, leaf in enumerate(p.graph_input_leaves)}
        self._tensor_inputs = (
            [position[i] for i in tensor_leaves] if all(i in position for i in tensor_leaves) else None
        )
        self._check_overlap = bool(p.donated_leaves)
        # Tensors the step captured (closure, global): graph constants the program reads at every call.
        self._captured = _captured_storages(p.graph_module) if p.donated_leaves else {}
        # Each captured tensor with the shape, dtype and device the program was compiled for, checked at a call when
        # its buffer address changed (what `model.double()` or `param.data = ...` do): one C-level map per call.
        self._constants = _captured_layouts(p.graph_module)
        self._constant_tensors = [value for _, value, _, _, _ in self._constants]
        self._constant_ptrs = list(map(_DATA_PTR, self._constant_tensors))
        self._input_kinds = [p.input_leaf_kind[i] for i in p.graph_input_leaves]
        # Call leaves that are static values (not tensors nor scalars): `Jitted._key`'s fast path hashes them.
        self._static_leaves = [i for i, kind in enumerate(p.input_leaf_kind) if kind == "static"]
        self._where = f"jitted '{p.name}'"
        self._warned = False
        self._switch: Any = None  # an exchange guard's ExchangeSwitch (pt3func/compress/guard.py), or None

    def __reduce_ex__(self, protocol: Any) -> Any:  # pickle, copy.copy and copy.deepcopy
        raise _refuse_copy(self)

    def exchange_decision(self) -> Any:
        """The exchange guard's `ExchangeDecision` (compression kept or switched off, the step times, the reason);
        None without a guard or while its trial calls are still running."""
        return None if self._switch is None else self._switch.decision

    def as_text(self) -> str:
        return self.lowered.as_text()

    def generated_code(self) -> str | None:
        """The Python program Inductor generated for this step (kernel launches, allocations, frees), as
        `TORCH_LOGS=output_code` would print it; None for the eager backend."""
        return self._wrapper_source

    def cost_analysis(self) -> dict[str, Any]:
        return self.lowered.cost_analysis()

    def memory_analysis(self) -> dict[str, int]:
        """Bytes of arguments, outputs, donated buffers, temporaries and peak of the compiled program.

        For an Inductor program, read from the code Inductor generated (after fusion and buffer reuse, see
        `pt3func.runtime.inductor_memory`); `peak_bytes` then estimates `torch.cuda.max_memory_allocated`
        of a call. For the eager backend, the traced program's liveness estimate (`Lowered.memory_analysis`).
        """
        if self._memory is None:
            p = self._program
            self._memory = analysis.memory_analysis(p.graph_module, _aliased_graph_inputs(p))
            if self._wrapper_source is not None:
                compiled = analysis.compiled_memory_analysis(
                    p.graph_module, _aliased_graph_inputs(p), self._wrapper_source
                )
                if compiled is not None:
                    self._memory = compiled
        return self._memory

    def donation_report(self) -> list[dict[str, Any]]:
        return self.lowered.donation_report()

    def report_unused_donations(self) -> None:
        """Warn (or raise under `config.strict_donation`) about donated leaves whose buffer is not reused."""
        p = self._program
        if not p.donation.unused:
            return
        lines = "\n".join(f"  {p.input_labels[i]}: {why}" for i, why in sorted(p.donation.unused.items()))
        message = f"{p.name}: some donated buffers cannot be reused and were not donated:\n{lines}"
        if config.strict_donation:
            raise DonationError(message + "\n(pf.config.strict_donation is on)")
        warnings.warn(message, stacklevel=4)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run on arguments of the signature this was compiled for (else raise: use the `Jitted` to retrace).

        Plain tensors where the program takes sharded ones are placed as `in_shardings` placed them at `lower()`
        (each rank keeps its block of the global value), so `step.lower(*args).compile()(*args)` runs."""
        if torch.compiler.is_compiling():  # under torch.compile: one call Dynamo does not trace into
            return call_opaque(self, *args, **kwargs)
        p = self._program
        if get_proxy_mode() is not None:
            # Its compiled program cannot run on the trace's fake tensors (Inductor's reads their data pointers).
            raise TracingError(
                f"{p.name}: a Compiled (step.lower(...).compile()) called inside a step that pf.jit is tracing; its "
                "compiled program cannot be traced into another. Call the jitted function itself there (it is "
                "inlined into the outer step's program)."
            )
        if self.lowered._virtual is not None and not virtual.in_rank_thread():
            return self._call_virtual(args, kwargs)
        dynamic, static = split_static(p.spec, args, kwargs)
        leaves, treedef = tree.flatten(dynamic)
        key = (treedef, static_key(static), static_types(static), tuple([leaf_key(leaf) for leaf in leaves]))
        if key != p.key:
            leaves = self._place_plain_leaves(leaves, key)
            key = (treedef, key[1], key[2], tuple([leaf_key(leaf) for leaf in leaves]))
            if key != p.key:
                raise TracingError(_signature_mismatch(p, key))
        changed = _guard_mismatch(p, dict_orders(p.spec, dynamic), static_module_modes(static))
        if changed is not None:
            raise TracingError(changed)
        return self.run_leaves(leaves)

    def _place_plain_leaves(self, leaves: list[Any], key: tuple) -> list[Any]:
        """The call's leaves with each plain tensor the program takes as a DTensor placed as at `lower()`: what
        `in_shardings` did there (`spmd.lower.apply_in_shardings`, which `Jitted.lower` applies before tracing)."""
        p = self._program
        if key[:3] != p.key[:3]:  # another structure or static values: nothing to place
            return leaves
        meshes = self._device_meshes(leaves)
        placed = list(leaves)
        for i, (leaf, want) in enumerate(zip(leaves, p.key[3])):
            if p.input_leaf_kind[i] != "dtensor" or not isinstance(leaf, torch.Tensor) or isinstance(leaf, DTensor):
                continue
            _, shape, dtype, mesh_id, placements, _ = want
            mesh = meshes.get(mesh_id)
            if mesh is None or leaf.shape != shape or leaf.dtype != dtype:
                continue  # not what the program takes: the signature error names it
            # A plain tensor is the global value every rank holds: each rank keeps its block, no communication.
            placed[i] = distribute_tensor(leaf, mesh, placements, src_data_rank=None)
        return placed

    def _device_meshes(self, leaves: list[Any]) -> dict[int, Any]:
        """id -> DeviceMesh of the meshes the program's DTensor inputs may live on (the signature names them by id)."""
        found: dict[int, Any] = {}
        for mesh in (self.lowered._mesh, get_mesh()):
            if mesh is not None:
                try:
                    found[id(mesh.device_mesh)] = mesh.device_mesh
                except Exception:  # noqa: BLE001 - a virtual mesh outside its rank threads has none
                    pass
        for meta in self._program.dtensor_out.values():
            found[id(meta.device_mesh)] = meta.device_mesh
        for leaf in leaves:
            if isinstance(leaf, DTensor):
                found[id(leaf.device_mesh)] = leaf.device_mesh
        return found

    def _call_virtual(self, args: tuple, kwargs: dict) -> Any:
        """Called outside a virtual mesh's rank threads: every rank runs its own program (lowered alongside this
        one, rank 0's) on its view of the arguments, as a jitted call there does; outputs are virtual arrays."""
        world, _ = self.lowered._virtual
        per_rank = self.lowered._ranks
        p = self._program
        mesh = virtual.find_mesh(args, kwargs) or self.lowered._mesh
        if per_rank is None or not isinstance(mesh, virtual.VirtualMesh):
            raise TracingError(
                f"{p.name}: this Compiled is one rank's program of a virtual mesh, not one that `step.lower(*args)` "
                "returned (which holds every rank's program); call the jitted function instead"
            )
        if mesh.world is not world:
            raise TracingError(
                f"{p.name}: this Compiled was lowered for the ranks of another virtual mesh than {mesh!r}, which the "
                "arguments live on; call the jitted function instead"
            )
        # Ranks given one Lowered (a signature that names no rank's own mesh: plain tensors under pf.set_mesh) compile
        # it once, in its first rank's thread, before every rank runs it: not two compiles rewriting one graph.
        first: dict[int, int] = {}
        for r, q in enumerate(per_rank):
            first.setdefault(id(q), r)
        if len(first) < len(per_rank):
            mesh.run(lambda r: per_rank[r].compile() if first[id(per_rank[r])] == r else None)
        outs = mesh.run(
            lambda r: per_rank[r].compile()(*virtual.scatter_tree(args, r), **virtual.scatter_tree(kwargs, r))
        )
        return virtual.gather_trees(mesh, outs)

    def run_leaves(self, leaves: list[Any]) -> Any:
        if self._switch is not None:
            return self._switch(leaves)
        return self._run_leaves(leaves)

    def _run_leaves(self, leaves: list[Any]) -> Any:
        return tree.unflatten(self._program.out_treedef, self.run_flat(leaves))

    def run_flat(self, leaves: list[Any]) -> list[Any]:
        """Run on the flat leaves of a call; the flat output leaves (no exchange guard: see `run_leaves`)."""
        p = self._program
        inputs = []
        for i, kind in zip(p.graph_input_leaves, self._input_kinds):
            leaf = leaves[i]
            if kind == "dtensor":
                leaf = leaf._local_tensor
            elif kind == "scalar" and not self._graphed:  # a graph fills its own scalar buffer
                leaf = scalar_tensor(leaf, p.scalar_dtypes[i], p.scalar_device, p.input_labels[i], p.name)
            inputs.append(leaf)
        if self._check_overlap:
            self._refuse_donation_overlap(leaves, inputs)
        if self._constant_tensors and list(map(_DATA_PTR, self._constant_tensors)) != self._constant_ptrs:
            self._check_captured_layouts()
        grad_enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # torch.no_grad() without the context manager's cost
        try:
            # A CUDA graph swaps each donated input in `inputs` for the captured buffer holding its new value.
            if self._draws_random and not self._graphed and virtual.in_rank_thread():
                with drawing_as_rank():  # a virtual rank's draws from its own generator
                    outs = self._runner(*inputs)
            else:
                outs = self._runner.run(inputs) if self._graphed else self._runner(*inputs)
        except RuntimeError:
            # Torch's "inplace update to inference tensor" for a donated one: named here rather than checked before
            # every call (the first call's compile checks it: `refuse_inference_donation`).
            refuse_inference_donation(p.name, p.input_labels, leaves, self._invalidate)
            raise
        finally:
            torch._C._set_grad_enabled(grad_enabled)
        out_leaves: list[Any] = [None] * p.out_treedef.num_leaves
        for j, value in p.out_constants.items():
            out_leaves[j] = value
        for j, value in zip(p.graph_output_leaves, outs):
            out_leaves[j] = value
        for j, gi in self._aliased_input_of.items():
            out_leaves[j] = inputs[gi].detach()
        for j, meta in p.dtensor_out.items():
            out_leaves[j] = meta.rebuild(out_leaves[j])
        for j, (sharding, path) in p.plain_out_shardings.items():
            out_leaves[j] = place_plain_output(out_leaves[j], sharding, path)
        for i in self._invalidate:
            invalidate(leaves[i], self._where)
        return out_leaves

    def _check_captured_layouts(self) -> None:
        """Refuse a captured tensor whose shape, dtype or device changed since the trace (its buffer was replaced:
        `param.data = bigger`, `model.double()`): the program would misread it (Inductor's kernels silently read
        garbage) or fail inside torch. A buffer replaced by one of the same layout is read as it is."""
        for name, value, shape, dtype, device in self._constants:
            if value.dtype is not dtype or value.shape != shape or value.device != device:
                raise TracingError(_captured_changed(self._program, name, value, shape, dtype, device))
        self._constant_ptrs = list(map(_DATA_PTR, self._constant_tensors))

    def _refuse_donation_overlap(self, leaves: list[Any], inputs: list[Any]) -> None:
        if self._captured:
            _check_donation_of_captured(self._program, leaves, self._captured)
        if self._tensor_inputs is not None:
            # The common case, from the program's tensor inputs alone (local tensors: no DTensor dispatch).
            ptrs = [inputs[k].untyped_storage().data_ptr() for k in self._tensor_inputs if inputs[k].numel()]
            if len(set(ptrs)) == len(ptrs):
                return
        _check_donation_overlap(self._program, leaves)

    def leaf_stays_valid(self, i: int) -> bool:
        """Whether input leaf `i` is still usable after a call (not donated and invalidated)."""
        return i not in self._invalidated

    def output_keys(self, out_leaves: list[Any]) -> list[Any]:
        """The signature key of each output tensor leaf (None for others). A program's outputs keep their layout
        from call to call, so they are read once."""
        if self._output_keys is None:
            self._output_keys = [leaf_key(x) if isinstance(x, torch.Tensor) else None for x in out_leaves]
        return self._output_keys


def scalar_tensor(value: Any, dtype: torch.dtype, device: torch.device, label: str, name: str) -> torch.Tensor:
    """A Python scalar argument as the 0-d tensor the program takes; a value that dtype cannot hold (an int
    beyond int64) named, where torch's own error names neither the argument nor the way out."""
    try:
        return torch.tensor(value, dtype=dtype, device=device)
    except (OverflowError, RuntimeError, ValueError) as exc:
        raise TracingError(
            f"{name}: argument {label} = {value!r} does not fit in {str(dtype).replace('torch.', '')}, the dtype a "
            f"Python {type(value).__name__} is traced as ({exc}): pass it as a tensor of a dtype that holds it, or "
            "make it static (static_argnums / static_argnames)"
        ) from None


def pair_rank_lowerings(per_rank: list[Lowered]) -> Lowered:
    """Rank 0's Lowered of one `lower()` job on a virtual mesh (`per_rank`: each rank's, in rank order), holding
    every rank's for its Compiled to run. Ranks that lowered another program than rank 0 are refused."""
    first = per_rank[0]._program
    for rank, lowered in enumerate(per_rank):
        p = lowered._program
        # The leaf keys name each rank's own DeviceMesh (by identity), so they differ by rank: their count is compared.
        if p.name != first.name or p.key[:3] != first.key[:3] or len(p.key[3]) != len(first.key[3]):
            raise TracingError(
                f"{first.name}: virtual rank {rank} lowered another program ({p.name}, {len(p.key[3])} leaves) than "
                f"rank 0 ({first.name}, {len(first.key[3])} leaves) for one `lower()` call; its ranks must lower the "
                "same step for the same arguments. Call the jitted function instead"
            )
    per_rank[0]._ranks = list(per_rank)
    return per_rank[0]


def _refuse_copy(stage: Lowered | Compiled) -> TypeError:
    """A Lowered / Compiled is not copied nor pickled: its program's graph keeps the trace's metadata (values, source
    lines: a pickle drops them, and its analyses then read 0), fake tensors and process groups (a deep copy fails
    on them) and a compiled runner (not picklable); a copy that runs would also no longer share captured tensors."""
    name = stage._program.name
    return TypeError(
        f"{name}: a pf.jit {type(stage).__name__} cannot be pickled or copied (its traced graph, fake tensors, "
        "process groups and compiled program do not survive a copy). Call `step.lower(*args)` (and `.compile()`) "
        "again where it is needed, or copy the jitted function itself (copy.deepcopy(step))"
    )


def _signature_mismatch(p: Program, key: tuple) -> str:
    """What differs between the signature `p` was compiled for and a call's `key`: pytree paths, old -> new."""
    treedef, static, types, leaf_keys = key
    if treedef != p.key[0]:
        reasons = [f"the pytree structure of the arguments changed: {p.key[0]} -> {treedef}"]
    elif static != p.key[1]:
        reasons = [f"static arguments changed: {p.key[1]} -> {static}"]
    elif types != p.key[2]:
        reasons = [f"the trace modes (autocast, inference mode, default dtype) or static argument types changed: "
                   f"{p.key[2]} -> {types}"]
    else:
        reasons = leaf_key_changes(leaf_labels(p.spec, treedef, static), p.key[3], leaf_keys)
    return (
        f"{p.name}: this Compiled was built for another signature: " + "; ".join(reasons[:10])
        + ". Call the jitted function instead, which traces again when needed"
    )


def _guard_mismatch(p: Program, orders: tuple, static_modes: tuple) -> str | None:
    """What differs, beyond `Program.key`, between the signature `p` was compiled for and a call's (the dicts' key
    orders, the modes of static modules, the modes and hooks of the modules its trace called); None if nothing.
    As for the Jitted, which traces again where these change: the program kept what the trace saw."""
    if orders != p.orders:
        was, now = next(((a, b) for a, b in zip(p.orders, orders) if a != b), (p.orders, orders))
        reason = f"the key order or type of a dict among the arguments changed: {was} -> {now}"
    elif static_modes != p.static_modes:
        reason = f"the train / eval mode of a module given as a static argument changed: {p.static_modes} -> " \
                 f"{static_modes}"
    else:
        watch, modes = p.modules
        now = watch.modes()
        if now == modes:
            return None
        reason = watch.describe_change(modes, now) or "the modes or hooks of modules the step calls changed"
    return (
        f"{p.name}: this Compiled was built for another signature: {reason}. Call the jitted function instead, which "
        "traces again when needed"
    )


def dict_orders(spec: ArgSpec, dynamic: Any) -> tuple:
    """The key order and type of every dict among a call's dynamic arguments (`(args, kwargs)`): a step may iterate
    a dict, and a treedef compares dicts by their sorted keys (a program traced for {"b", "a"} ran for {"a", "b"}).
    Keyword arguments bound to named parameters are order-free (`f(a=x, b=y)` then `f(b=y, a=x)` runs the same
    program); their order counts only for a function with `**kwargs`, which may iterate them."""
    dyn_args, dyn_kwargs = dynamic
    if dyn_kwargs and not spec.var_keyword:
        dynamic = (dyn_args, [dyn_kwargs[k] for k in sorted(dyn_kwargs)])
    out: list[Any] = []
    _collect_dict_orders(dynamic, out)
    return tuple(out)


def _collect_dict_orders(x: Any, out: list[Any]) -> None:
    """Depth first, in insertion order: each dict's keys, with the type (and default factory) of an OrderedDict /
    defaultdict: what a treedef and `flatten_up_to` leave out. Walks dicts, lists and tuples (namedtuples too); a
    dict inside another kind of node is not looked at."""
    t = type(x)
    if t is dict:
        out.append(tuple(x))
        values: Any = x.values()
    elif t is OrderedDict or t is defaultdict:
        out.append((t, _factory_key(x.default_factory) if t is defaultdict else None, tuple(x)))
        values = x.values()
    elif t is tuple or t is list or isinstance(x, tuple):
        values = x
    else:
        return
    for v in values:
        t = type(v)
        if t in _WALKED or (t not in _LEAVES and isinstance(v, tuple)):  # the common leaves: no call
            _collect_dict_orders(v, out)


def _factory_key(factory: Any) -> Any:
    """A defaultdict's factory as the signature sees it: a function by its code (a `lambda: 0` made anew for each
    call is the same factory; by identity every call retraced), anything else (a type) as itself."""
    code = getattr(factory, "__code__", None)
    return factory if code is None else code


_WALKED = frozenset({dict, OrderedDict, defaultdict, list, tuple})
_LEAVES = frozenset({torch.Tensor, DTensor, float, int, bool})


def _call(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


# A jitted step (or a Compiled) called from code that torch.compile compiles (a loop body): Dynamo runs the call as
# it is, one opaque function (a graph break), instead of tracing into pt3func's signature checks, donation and
# compiled program, which it cannot (it wrapped donated tensors, hit its recompile limits, and took minutes).
call_opaque = torch.compiler.disable(
    _call, reason="a pf.jit step runs its own compiled program: torch.compile calls it as it is"
)


def _aliased_graph_inputs(p: Program) -> list[int]:
    """Graph input indices of the donated leaves whose buffers an output reuses."""
    leaves = p.donation.donated_inputs
    return [gi for gi, leaf in enumerate(p.graph_input_leaves) if leaf in leaves]


def _captured_storages(gm: fx.GraphModule) -> dict[int, str]:
    """Storage address -> name of each tensor a program holds as a constant (what its step captured)."""
    out = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target, None)
            if isinstance(value, torch.Tensor) and value.numel() and not isinstance(value, FakeTensor):
                out[value.untyped_storage().data_ptr()] = str(node.target)
    return out


_DATA_PTR = torch.Tensor.data_ptr


def _captured_layouts(gm: fx.GraphModule) -> list[tuple[str, torch.Tensor, torch.Size, torch.dtype, torch.device]]:
    """(name, tensor, shape, dtype, device) of each tensor a program holds as a constant (what its step captured)."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target, None)
            # Plain tensors and parameters (a tensor subclass's data_ptr may dispatch or refuse).
            if type(value) in (torch.Tensor, torch.nn.Parameter):
                out.append((str(node.target), value, value.shape, value.dtype, value.device))
    return out


def _captured_changed(p: Program, name: str, value: torch.Tensor, shape: torch.Size, dtype: torch.dtype,
                      device: torch.device) -> str:
    """Which captured tensor changed its layout since `p` was traced, where the step uses it, old -> new."""
    from pt3func.trace.source import describe, user_frame_in_stack_trace

    where = ""
    node = next((n for n in p.graph_module.graph.nodes if n.op == "get_attr" and str(n.target) == name), None)
    for user in node.users if node is not None else ():
        frame = user_frame_in_stack_trace(user.meta.get("stack_trace"))
        if frame is not None:
            where = f", used at {describe(*frame)}"
            break

    def layout(s: torch.Size, d: torch.dtype, dev: torch.device) -> str:
        return f"{str(d).removeprefix('torch.')}{list(s)} on {dev}"

    return (
        f"{p.name}: a tensor the step captures from outside (a closure's or global's, such as a closure model's "
        f"parameter; graph constant {name}{where}) changed from {layout(shape, dtype, device)} to "
        f"{layout(value.shape, value.dtype, value.device)} since the step was traced (`model.double()`, "
        "`param.data = ...`). The program reads captured tensors at every call but keeps their shape, dtype and "
        "device: pass the model's state as an argument (pf.functionalize), or jit the step again after changing it."
    )


def refuse_donating_captured(p: Program, leaves: list[Any]) -> None:
    """`_check_donation_of_captured` for a program not compiled yet."""
    if p.donated_leaves:
        captured = _captured_storages(p.graph_module)
        if captured:
            _check_donation_of_captured(p, leaves, captured)


def _check_donation_of_captured(p: Program, leaves: list[Any], captured: dict[int, str]) -> None:
    """Refuse donating a buffer the step also reads as a captured tensor (a closure's or a global's)."""
    for i in p.donated_leaves:
        leaf = leaves[i]
        if isinstance(leaf, torch.Tensor) and leaf.numel():
            local = getattr(leaf, "_local_tensor", leaf)
            if local.untyped_storage().data_ptr() in captured:
                raise DonationError(
                    f"{p.name}: donated {p.input_labels[i]} shares its buffer with a tensor the step captures (a "
                    "closure's or a global's, read by the program at every call): the step would overwrite memory "
                    "it still reads. Pass that tensor as an argument instead, or do not donate."
                )


def _check_donation_overlap(p: Program, leaves: list[Any]) -> None:
    """Refuse a call where a donated buffer is also passed elsewhere (twice donated, or donated and read)."""
    seen: dict[int, int] = {}
    donated = set(p.donated_leaves)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) or leaf.numel() == 0 or leaf.device.type == "meta":
            continue  # a meta tensor has no buffer (every one's data_ptr is 0): a dry run overwrites nothing
        local = getattr(leaf, "_local_tensor", leaf)
        ptr = local.untyped_storage().data_ptr()
        other = seen.get(ptr)
        if other is not None and (i in donated or other in donated):
            raise DonationError(
                f"{p.name}: {p.input_labels[other]} and {p.input_labels[i]} share one buffer, and at least one "
                "of them is donated: the step would overwrite memory it still reads. Pass a copy (.clone()) "
                "or do not donate it."
            )
        seen[ptr] = i
