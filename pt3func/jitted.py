"""`pf.jit`: trace a whole pure step into one static program, compile it once per signature, cache it."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import logging
import numbers
import os
import pickle
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from pt3func import tree
from pt3func.compress.formats import Format
from pt3func.compress.guard import (
    ExchangeSwitch,
    check_exchange_guard,
    copy_program,
    forward_unchanged_inputs,
    guard_for,
)
from pt3func.config import config
from pt3func.errors import DataDependentControlFlowError, DonationError, ShardingError, TracingError
from pt3func.passes import grad_exchange
from pt3func.passes.backward_fence import backward_op, keep_backward_in_backward
from pt3func.passes.bucketing import bucket_gradient_all_reduces
from pt3func.passes.chunked_loss import chunk_cross_entropy
from pt3func.passes.donation import LeafMeta, apply_donation, plan_donation
from pt3func.passes.gather_cast import cast_before_gather
from pt3func.passes.merge_collectives import merge_duplicate_collectives
from pt3func.passes.overlap import issue_collectives_early, order_by_readiness, sink_waits
from pt3func.passes.remat import fence_recomputation, remat_notes, rematerialize
from pt3func.passes.remat_budget import fit_memory_budget
from pt3func.runtime.backend import BACKENDS
from pt3func.runtime.donated import is_donated, refuse_inference_donation
from pt3func.runtime.virtual import VirtualWorld, find_mesh, in_rank_thread, mesh_of_shardings, scatter_tree
from pt3func.runtime.virtual import call as virtual_call
from pt3func.sharding.mesh import get_mesh
from pt3func.sharding.spec import NamedSharding, PartitionSpec
from pt3func.spmd import lower
from pt3func.spmd.decompose import decomposing_ops_without_rules
from pt3func.spmd.overrides import ShardedTraceOverrides
from pt3func.spmd.partial_sums import reducing_partial_sums
from pt3func.stages import (
    Compiled,
    Lowered,
    Program,
    call_opaque,
    dict_orders,
    pair_rank_lowerings,
    refuse_donating_captured,
    scalar_tensor,
)
from pt3func.trace import capture
from pt3func.trace.leaf_memo import LastCall, LeafKeyMemo
from pt3func.trace.module_modes import (
    NO_WATCH,
    ModuleWatch,
    Recording,
    recording_called_modules,
    static_module_modes,
)
from pt3func.trace.signature import (
    SCALAR_TYPES,
    ArgSpec,
    check_hashable,
    describe_leaf,
    leaf_argument,
    leaf_key,
    leaf_key_changes,
    leaf_labels,
    names_dead_module,
    rebuild_call,
    split_static,
    static_key,
    static_modules,
    static_types,
)
from pt3func.transforms import EAGER_DIFFERENTIATION

log = logging.getLogger("pt3func.jit")


class Jitted:
    """A function compiled by `pf.jit`: call it, or stop at `lower(...)` to look at the program."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        in_shardings: Any = None,
        out_shardings: Any = None,
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
        donate_argnums: int | Sequence[int] = (),
        donate_argnames: str | Sequence[str] = (),
        grad_exchange: Any = None,
        exchange_guard: Any = "auto",
        memory_budget: float | None = None,
        backend: str = "inductor",
        cuda_graphs: bool = False,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"pf.jit: unknown backend {backend!r}; choose one of {BACKENDS}")
        memory_budget = _budget_fraction(memory_budget)
        if grad_exchange is not None and not isinstance(grad_exchange, Format):
            raise TypeError(
                f"pf.jit: grad_exchange must be a pf.compress format (pf.compress.int8(), ...), got {grad_exchange!r}"
            )
        check_exchange_guard(exchange_guard)
        # What a copy or an unpickled Jitted of another `fn` is made with (`__deepcopy__`, `__reduce__`).
        self._options = dict(
            in_shardings=in_shardings, out_shardings=out_shardings, static_argnums=static_argnums,
            static_argnames=static_argnames, donate_argnums=donate_argnums, donate_argnames=donate_argnames,
            grad_exchange=grad_exchange, exchange_guard=exchange_guard, memory_budget=memory_budget, backend=backend,
            cuda_graphs=cuda_graphs,
        )
        self.fn = fn
        self.name = _name_of(fn)
        self._spec = ArgSpec.build(fn, static_argnums, static_argnames, donate_argnums, donate_argnames)
        self.in_shardings = in_shardings
        self.out_shardings = out_shardings
        self.grad_exchange = grad_exchange
        self.exchange_guard = exchange_guard
        self.memory_budget = memory_budget
        self.backend = backend
        self.cuda_graphs = bool(cuda_graphs)
        self._cache: dict[Any, Compiled] = {}
        self._lowered: dict[Any, Lowered] = {}  # lowered but not yet called: the first call compiles these
        self._traces = 0  # signatures traced so far (cache misses): `trace_count()`
        # The signature traced last (treedef, labels, descriptions, key), which `_explain_miss` compares a miss with;
        # _CLEARED after `clear_cache()`.
        self._last_seen: tuple[Any, list[str], list[str], Any] | None = None
        self._many_warned = False  # the one warning about many signatures cached (`_warn_many_signatures`)
        # id -> a weak reference, with a callback, to each module that keys a cached signature (`ModuleKey`): when
        # the module dies its signatures are dropped, with the captured tensors of their programs.
        self._module_refs: dict[int, weakref.ref] = {}
        self._agreed: set = set()  # plain-input signatures the ranks of a process world were checked to agree on
        # Per signature (all of the key but its last entry): the module sets its traces called, whose train / eval
        # modes (`ModuleWatch.modes()`) are the key's last entry.
        self._watches: dict[tuple, list[ModuleWatch]] = {}
        self._leaf_memo = LeafKeyMemo(leaf_key)  # keys of the leaves the last call returned (and kept valid)
        # updated=(): copying fn.__dict__ (a pf.grad / functools.wraps wrapper of another Jitted carries that one's
        # attributes) over ours made this Jitted run the inner function, with the inner one's options. A user's own
        # attributes of fn are still copied, where they name nothing of ours.
        functools.update_wrapper(self, fn, updated=())
        for name, value in getattr(fn, "__dict__", {}).items():
            if not name.startswith("_") and name not in self.__dict__:
                self.__dict__[name] = value

    def _key(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, list[Any], Any, tuple, Compiled | None, tuple, Any]:
        """(key, leaves, treedef, static, the signature's program if compiled, leaf keys, the static values' hashes
        where the last call's program is reused without hashing the signature, else None)."""
        dynamic, static = split_static(self._spec, args, kwargs)
        skey = static_key(static)  # as the key holds it: modules weakly
        types = static_types(static)
        # Bare PartitionSpecs in the shardings, `pf.shard_map` without `mesh=` and `with_sharding_constraint` /
        # `device_put` inside the step resolve through the current mesh (`pf.set_mesh`) when the step is traced: that
        # mesh (by identity, as a DTensor leaf's) is the last entry of `types` (a step called again under another
        # mesh ran the first mesh's program). In a virtual mesh's rank thread, with the rank: each rank traces its own
        # program (its collectives name its own process groups), and a signature that names no rank's own mesh (plain
        # tensors under pf.set_mesh) kept one rank's program for all, which the other ranks ran once their last call
        # was another signature (`Program.key` leaves this entry out: a rank's Compiled checks no rank).
        types += (("mesh", get_mesh()) if not in_rank_thread() else ("mesh", get_mesh(), torch.distributed.get_rank()),)
        # The key order and type of every dict among the arguments (order-free for named parameters).
        orders = dict_orders(self._spec, dynamic)
        static_modes = static_module_modes(static)
        last = self._leaf_memo.last()
        # Its program weakly: one dropped (a module of its signature died, `clear_cache()`) is freed, not kept by
        # the last call of every thread that ran it.
        last_compiled = last.compiled() if last is not None else None
        if last_compiled is not None:
            # The loop's common case: the last call's signature again. Its structure is checked while its leaves
            # are taken (`flatten_up_to`: no sorting of dict keys; it takes a dict for an OrderedDict, so the dicts'
            # types and key orders are compared apart), its DTensor keys are the very objects when it returned
            # those leaves (compared by identity); then its program again, the signature not hashed: only the static
            # values (`last.static` holds them with their hashes then, see `_static_hashes`).
            try:
                leaves = last.treedef.flatten_up_to(dynamic)
            except (ValueError, TypeError):  # another structure
                leaves = None
            if leaves is not None and last.static[0] == skey and last.key[2] == types and last.key[4] == orders \
                    and last.key[5] == static_modes and last.key[6][0].modes() == last.key[6][1]:
                leaf_keys = self._leaf_keys(leaves, last.treedef, static)
                # (a subtree where the last call had a leaf has a key of its own)
                if last.leaf_keys == leaf_keys:
                    hashes = _static_hashes(skey, leaves, last_compiled)
                    if hashes == last.static[1]:
                        return last.key, leaves, last.treedef, static, last_compiled, leaf_keys, hashes
        leaves, treedef = tree.flatten(dynamic)
        while tree.adopt_torch_nodes(leaves):  # a Hugging Face ModelOutput passed in: its tensors are inputs
            leaves, treedef = tree.flatten(dynamic)
        leaf_keys = self._leaf_keys(leaves, treedef, static)
        try:
            # The program's signature (`Program.key`, as `Compiled.__call__` computes it), the dicts' orders, the
            # modes of modules given as static arguments, and of the modules its trace called: (watch, modes).
            base = (treedef, skey, types, leaf_keys, orders, static_modes)
            key = base + ((NO_WATCH, ()),)
            compiled = None
            for watch in self._watches.get(base, ()):  # hashes the key: an unhashable static leaf fails here
                candidate = base + ((watch, watch.modes()),)
                compiled = self._cache.get(candidate)
                if compiled is not None or candidate in self._lowered:
                    key = candidate
                    break
        except TypeError:
            check_hashable(static, lambda: [repr(s) for s in static], self._spec)
            bad = [
                label
                for label, leaf in zip(leaf_labels(self._spec, treedef, static), leaves)
                if not isinstance(leaf, (torch.Tensor, *SCALAR_TYPES)) and not _hashable(leaf)
            ]
            raise TracingError(
                f"{self.name}: arguments {', '.join(bad)} are neither tensors nor Python scalars, so they are "
                "treated as static values, which must be hashable. Convert them to tensors or make them hashable."
            ) from None
        if compiled is None:
            _refuse_tensor_statics(self.name, static)
        return key, leaves, treedef, static, compiled, leaf_keys, None

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """A jitted method binds its instance as the function it wraps would (`self` is the first argument: static,
        as an object that is not a tensor, or name it in static_argnums): `net.forward(x)`, `net.forward.lower(x)`.
        A jitted partial, builtin or callable object is not bound, as Python binds none of them."""
        if obj is None or not isinstance(self.fn, types.FunctionType):
            return self
        return BoundJitted(self, obj)

    def __reduce__(self) -> Any:
        # A module-level `@pf.jit def f` is pickled by reference, as the function it decorates is. Any other is
        # rebuilt from its function and options (a bound method with its instance, a module with its weights, as
        # pickle takes them): by name it would run the original object. Compiled programs are not picklable state.
        if _named_global(self):
            return self.__qualname__
        if isinstance(self.fn, types.FunctionType) and "<" in self.fn.__qualname__:
            raise pickle.PicklingError(
                f"pf.jit({self.name}) cannot be pickled: it wraps a local function or lambda, which pickle cannot "
                "name. Define the function at module level"
            )
        return _rebuild, (self.fn, self._options)

    def __copy__(self) -> Jitted:
        return self  # as for a function (a shallow copy would call the same function, on the same object)

    def __deepcopy__(self, memo: dict) -> Jitted:
        if isinstance(self.fn, types.FunctionType):
            return self  # as for a function: an object holding a step (a trainer) deep-copies its state, not its code
        # A bound method (`pf.jit(self.forward)`), a module (`pf.jit(model)`), a partial or callable object: its copy
        # runs the copied object, as the plain bound method's copy would (returning self ran the original object:
        # the copy's own weights were never read). Same options, a cache of its own (programs captured the original).
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied  # the copied fn may reach this Jitted again (an instance that holds its own step)
        fn = copy.deepcopy(self.fn, memo)
        if fn is self.fn:  # (a builtin): nothing to copy
            memo[id(self)] = self
            return self
        copied.__init__(fn, **self._options)
        return copied

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # under torch.compile: one call Dynamo does not trace into
            return call_opaque(self, *args, **kwargs)
        if get_proxy_mode() is not None:  # called from a step another pf.jit is tracing: inlined, as in jax.jit
            return self.fn(*args, **kwargs)
        if torch._C._functorch.peek_interpreter_stack() is not None and _any_functorch_wrapped((args, kwargs)):
            raise TracingError(
                f"{self.name}: a pf.jit-ed function called under a pf.vmap / torch.func transform applied from "
                "outside (pf.vmap(pf.jit(f))): its compiled program cannot be batched or differentiated by it. Put the "
                "transform inside: pf.jit(pf.vmap(f))."
            )
        if VirtualWorld._installed and not in_rank_thread():
            vmesh = find_mesh(args, kwargs) or mesh_of_shardings(self.in_shardings, self.out_shardings)
            if vmesh is not None:
                # This call's own: the rank threads name the caller's tensors their placed copies donated (one
                # attribute of the Jitted was reset by another thread's call in between, and those stayed readable).
                donated: dict[int, str] = {}
                out = virtual_call(vmesh, functools.partial(self._on_rank, donated), args, kwargs)
                lower.invalidate_call_leaves((args, kwargs), donated)
                return out
        replaced: list[tuple[torch.Tensor, torch.Tensor]] = []
        given = (args, kwargs)
        if self.in_shardings is not None:
            args, kwargs = lower.apply_in_shardings_to_call(
                args, kwargs, self.in_shardings, self._spec.static_argnums, self._spec.static_argnames,
                self._spec.param_names, (self.name, self._agreed), replaced=replaced,
            )
        key, leaves, treedef, static, compiled, leaf_keys, hashes = self._key(args, kwargs)
        if getattr(EAGER_DIFFERENTIATION, "depth", 0) and _any_requires_grad(leaves):
            raise TracingError(
                f"{self.name}: a pf.jit-ed function differentiated from outside (pf.grad(pf.jit(f))): its program "
                "runs without autograd, so the gradient through it would be zero. Put the gradient inside: "
                "pf.jit(pf.grad(f)) (or pf.jit(pf.value_and_grad(f)))."
            )
        if compiled is None:
            # One thread traces and compiles a signature; others calling it meanwhile wait and run its program (each
            # traced and compiled it again). Rank threads take no lock: each traces its own program.
            with self._signature_lock(key):
                key, compiled = self._compiled_meanwhile(key)
                if compiled is None:
                    lowered = self._lowered.pop(key, None) or self._lower_from(leaves, treedef, static, key)
                    key = _watched_key(key, lowered)  # keyed by the modes of the modules the trace called
                    compiled = self._compile(lowered, leaves, key)
                    self._cache[key] = compiled
            if torch.is_grad_enabled() and _any_requires_grad(leaves):
                warnings.warn(
                    f"{self.name}: called with tensors that require grad; the compiled program's outputs carry no "
                    "autograd graph (.backward() through them reaches nothing). Take gradients inside the step "
                    "(pf.grad / pf.value_and_grad), or pass tensors that do not require grad (.detach(), "
                    "pf.functionalize's params).",
                    stacklevel=2,
                )
        if compiled._switch is not None:  # an exchange guard picks the program
            if compiled._switch.program is None:  # still in its trials: two programs, the outputs not remembered
                self._leaf_memo.forget()
                result = compiled.run_leaves(leaves)
                self._invalidate_replaced(replaced, given)
                return result
            compiled = compiled._switch.program  # decided: the chosen program runs as any other
        out_leaves = compiled.run_flat(leaves)
        self._invalidate_replaced(replaced, given)
        # After the launch (on a GPU this overlaps the step): the signature of the next call's likely leaves.
        self._leaf_memo.remember(
            leaves,
            leaf_keys,
            compiled.leaf_stays_valid,
            out_leaves,
            compiled.output_keys(out_leaves),
            LastCall(treedef, (key[1], _static_hashes(key[1], leaves, compiled) if hashes is None else hashes),
                     leaf_keys, key, weakref.ref(compiled)),
        )
        return tree.unflatten(compiled._program.out_treedef, out_leaves)

    def _compile(self, lowered: Lowered, leaves: list[Any], key: tuple) -> Compiled:
        """Compile a call's trace. Where that raises (Ctrl-C in Inductor's compile, strict_donation refusing an
        unused donation), the trace is kept for the signature's next call: tracing it again counted a second cache
        miss for a signature that never changed."""
        program = lowered._program
        refuse_inference_donation(program.name, program.input_labels, leaves,
                                  [i for i in program.donated_leaves if i in program.donation.donated_inputs])
        # The compile rewrites the graph in place (the backend's passes): an interrupted one may leave it half done,
        # so the next call compiles a copy taken before.
        pristine = _snapshot(program) if lowered._compiled is None else None
        try:
            refuse_donating_captured(program, leaves)  # before Inductor compiles it (AOTAutograd fails)
            compiled = lowered.compile()
            compiled.report_unused_donations()  # a compile that succeeded is kept in `lowered` for the retry
        except BaseException:
            if lowered._compiled is None and pristine is not None:
                program.graph_module, program.notes = pristine
            lowered._example_inputs = None  # as `lower()` keeps it: the caller's tensors are not held
            self._lowered[key] = lowered
            raise
        return compiled

    def _on_rank(self, donated: dict[int, str], /, *args: Any, **kwargs: Any) -> Any:
        """A virtual call in one rank thread: `donated` is the caller's call's, which `_invalidate_replaced` fills."""
        _RANK_CALL.donated = donated
        try:
            return self(*args, **kwargs)
        finally:
            _RANK_CALL.donated = None

    def _signature_lock(self, key: tuple) -> Any:
        """The lock under which one signature (the key but the modes of the modules its trace calls) is traced and
        compiled; none in a virtual mesh's rank threads, which trace at once, each its own program (its signature
        names its rank's mesh), and whose callers are served one at a time (`VirtualWorld.run`)."""
        if in_rank_thread():
            return contextlib.nullcontext()
        with _LOCKS_GUARD:
            locks = _SIGNATURE_LOCKS.get(self)
            if locks is None:
                locks = _SIGNATURE_LOCKS[self] = {}
            # Reentrant: a thread compiling the signature that calls it again waits for nothing.
            return locks.setdefault(key[:6], threading.RLock())

    def _compiled_meanwhile(self, key: tuple) -> tuple[tuple, Compiled | None]:
        """The signature's program if another thread compiled it while this one waited for its lock (under the
        key with the modes of the modules its trace called, as `_key` finds it), else (key, None)."""
        if in_rank_thread():
            return key, None
        base = key[:6]
        for candidate in (key, *[base + ((watch, watch.modes()),) for watch in self._watches.get(base, ())]):
            compiled = self._cache.get(candidate)
            if compiled is not None:
                return candidate, compiled
        return key, None

    def _invalidate_replaced(self, replaced: list[tuple[torch.Tensor, torch.Tensor]], given: tuple) -> None:
        """A caller's tensor that in_shardings replaced by a placed copy is invalidated when the copy was donated;
        in a virtual rank thread (the tensor a copy of the caller's), the caller's call is told which."""
        if replaced:
            donated = lower.invalidate_donated_originals(replaced, given)
            target = getattr(_RANK_CALL, "donated", None)
            if donated and target is not None and in_rank_thread():
                target.update(donated)

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Trace and lower for these arguments (nothing is run, nothing is donated)."""
        if VirtualWorld._installed and not in_rank_thread():
            vmesh = find_mesh(args, kwargs) or mesh_of_shardings(self.in_shardings, self.out_shardings)
            if vmesh is not None:  # every rank lowers its own program; rank 0's is shown, holding the others'
                return pair_rank_lowerings(
                    vmesh.run(lambda rank: self.lower(*scatter_tree(args, rank), **scatter_tree(kwargs, rank)))
                )
        if self.in_shardings is not None:
            args, kwargs = lower.apply_in_shardings_to_call(
                args, kwargs, self.in_shardings, self._spec.static_argnums, self._spec.static_argnames,
                self._spec.param_names, (self.name, self._agreed),
            )
        key, leaves, treedef, static, _, _, _ = self._key(args, kwargs)
        lowered = self._lowered.get(key)
        if lowered is None:
            # A signature called before is traced again (compiling rewrote its program's graph for the backend, so
            # that text is no longer the lowered one), but that is no cache miss to explain, and `.compile()`
            # returns the program already compiled.
            called = self._cache.get(key)
            lowered = self._lower_from(leaves, treedef, static, key, miss=called is None)
            # Kept for a later compile (or `as_text()`): holding the arguments would keep the caller's params,
            # state and batch alive as long as this Jitted; compile() rebuilds inputs from the traced metadata.
            lowered._example_inputs = None
            key = _watched_key(key, lowered)
            self._lowered[key] = lowered
            lowered._compiled = self._cache.get(key)
        return lowered

    def _watch(self, key: tuple, recording: Recording) -> ModuleWatch:
        """The watch of a trace that called these modules: the signature's existing one for the same modules."""
        watch = ModuleWatch(recording)
        watches = self._watches.setdefault(key[:6], [])
        # A watch whose modules died is dropped with its programs: its modes read None from then on, and a new
        # module can take a dead one's id, which must not find the dead watch (nor its keys, traced with None).
        dead = [known for known in watches if not known.alive()]
        if dead:
            watches[:] = [known for known in watches if known.alive()]
            self._drop(lambda k: len(k) > 6 and any(k[6][0] is d for d in dead))
        for known in watches:
            if known.ids == watch.ids:
                return known
        watches.append(watch)
        return watch

    def exchange_decision(self) -> Any:
        """The exchange guard's decision (`pf.compress.ExchangeDecision`) for the signature compiled last that has
        one; None before the guard's trial calls end, or without a guard. For one signature:
        `step.lower(*args).compile().exchange_decision()`."""
        for compiled in reversed(list(self._cache.values())):
            decision = compiled.exchange_decision()
            if decision is not None:
                return decision
        return None

    def trace_count(self) -> int:
        """How many distinct signatures have been traced (the number of cache misses so far, those `clear_cache()`
        or a module's death dropped included)."""
        return self._traces

    def clear_cache(self) -> None:
        """Drop every program traced and compiled for this function, as `jax.jit(f).clear_cache()`: the next call
        of each signature traces and compiles again, and what the programs held (tensors the step captured, compiled
        code, CUDA graphs) is freed. On a jitted method (`Net.forward.clear_cache()` or `net.forward.clear_cache()`)
        that is the programs of every instance. `trace_count()` goes on counting; a `Lowered` / `Compiled` the caller
        holds (`step.lower(...)`) stays usable."""
        self._cache = {}
        self._lowered = {}
        self._watches = {}
        self._module_refs = {}
        with _LOCKS_GUARD:  # the signatures' locks (their keys hold the static arguments)
            _SIGNATURE_LOCKS.pop(self, None)
        self._last_seen = _CLEARED
        # Every thread's last call (the fast path's program and the leaf keys it remembers) with it.
        self._leaf_memo = LeafKeyMemo(leaf_key)

    def _drop(self, stale: Callable[[tuple], bool]) -> None:
        """Drop the signatures whose keys are `stale`: their programs, lowerings, module watches and locks.

        Also runs in a weakref callback (`_module_died`), in any thread, at any allocation: the tables are iterated
        through copies (`dict.copy()` is one step under the GIL) and entries popped, so neither another thread nor
        the code the callback interrupted finds a table changed under its iteration."""
        for table in (self._cache, self._lowered, self._watches, _SIGNATURE_LOCKS.get(self) or {}):
            for key in [k for k in table.copy() if stale(k)]:
                table.pop(key, None)

    def _drop_when_modules_die(self, leaves: list[Any], static: tuple) -> None:
        """Have the death of each module a signature keys by `ModuleKey` (a jitted method's `self`) drop every
        signature that names a dead module: no call matches them again, and their programs hold the module's
        captured parameters."""
        for module in static_modules(leaves, static):
            known = self._module_refs.get(id(module))
            if known is None or known() is not module:
                died = functools.partial(_module_died, weakref.ref(self), id(module))
                self._module_refs[id(module)] = weakref.ref(module, died)

    def _warn_many_signatures(self) -> None:
        """Log once when this function holds `_MANY_SIGNATURES` programs (as torch.compile's recompile limit
        warns): a step traced again for every new shape or static value spends its time compiling."""
        if self._many_warned or len(self._cache) + len(self._lowered) + 1 < _MANY_SIGNATURES:
            return
        # (once each: a signature both lowered and compiled, or traced by each rank thread of a virtual mesh)
        keys = {k for k in self._cache.copy().keys() | self._lowered.copy().keys() if k[2][-1][2:] in ((), (0,))}
        if len(keys) + 1 < _MANY_SIGNATURES:
            return
        self._many_warned = True
        log.warning(
            "%s: %d signatures are now traced and compiled, each a program of its own (logged once). Arguments "
            "whose shapes or static values change from call to call trace and compile again every time: pad or "
            "bucket shapes, pass changing numbers as traced (not static) arguments, and set "
            "pf.config.explain_cache_misses = True to log why each call traced again. clear_cache() drops them.",
            self.name, _MANY_SIGNATURES,
        )

    def _explain_miss(
        self, labels: list[str], descriptions: list[str], treedef: Any, static: tuple, key: Any
    ) -> None:
        if self._last_seen is None:
            log.warning("%s: tracing for the first time", self.name)
            return
        if self._last_seen is _CLEARED:
            log.warning("%s: tracing again because clear_cache() dropped its programs", self.name)
            return
        from pt3func.trace import signature as sig  # (the explaining helpers: only on this slow path)

        old_treedef, old_labels, old_desc, old_key = self._last_seen
        reasons = []
        if old_treedef != treedef:
            # By path (`params['w_extra'] added`): two whole treedefs of a model's parameters hide the one key.
            paths = sig.structure_changes(self._spec, old_treedef, old_key[1], treedef, key[1])
            reasons.append(f"the pytree structure of the arguments changed: {', '.join(paths[:10])}" if paths
                           else f"the pytree structure of the arguments changed: {old_treedef} -> {treedef}")
        else:
            for label, a, b in zip(labels, old_desc, descriptions):
                if a != b:
                    reasons.append(f"{label}: {a} -> {b}")
        if not reasons and old_key[1] != key[1]:
            # Only the static arguments that differ, by parameter name (the whole key held every one, by position).
            reasons.extend(sig.static_changes(self._spec, old_key[1], key[1])
                           or [f"static arguments changed: {old_key[1]} -> {key[1]}"])
        if not reasons and old_key[2][-1] != key[2][-1]:
            reasons.append(f"the current mesh (pf.set_mesh), which bare PartitionSpecs (in_shardings, out_shardings, "
                           f"shard_map, with_sharding_constraint) resolve through, changed: {old_key[2][-1][1]} -> "
                           f"{key[2][-1][1]}")
        if not reasons and old_key[2] != key[2]:
            # A static value of another type that compares equal (`2` -> `2.0`) names its argument.
            reasons.extend(sig.static_changes(self._spec, old_key[1], key[1])
                           or [f"the trace modes (autocast, inference mode, default dtype) or static argument types "
                               f"changed: {old_key[2]} -> {key[2]}"])
        if not reasons and old_key[4] != key[4]:
            was, now = next(((a, b) for a, b in zip(old_key[4], key[4]) if a != b), (old_key[4], key[4]))
            reasons.append(f"the key order or type of a dict among the arguments changed: {was} -> {now}")
        if not reasons and old_key[5] != key[5]:
            reasons.extend(sig.static_module_mode_changes(self._spec, key[1], old_key[5], key[5])
                           or [f"the train / eval mode of a module given as a static argument changed: {old_key[5]} "
                               f"-> {key[5]}"])
        if not reasons and old_key[:6] == key[:6]:
            old_watch, old_modes = old_key[6]
            reasons.append(
                old_watch.describe_change(old_modes, old_watch.modes())
                or "nothing in the signature changed since the last trace (arguments, static values, modes and the "
                "modes of the modules it called are the same), but that trace left no compiled program"
            )
        if not reasons:
            # A module leaf (a jitted method's `self`) in the other mode is a mode change, not a new signature leaf.
            reasons.extend(sig.module_mode_changes(labels, old_key[3], key[3]))
        if not reasons:
            changes = "; ".join(leaf_key_changes(labels, old_key[3], key[3])[:5]) or "none found"
            reasons.append(f"a leaf's signature changed (strides, device, mesh or module instance): {changes}")
        log.warning("%s: tracing again because %s", self.name, "; ".join(reasons[:10]))

    def _leaf_keys(self, leaves: list[Any], treedef: Any, static: tuple) -> tuple:
        """The leaves' signature keys; a leaf donated to an earlier call is a DonationError naming its argument's
        path (reading its shape raises one that names none)."""
        try:
            return tuple(self._leaf_memo.keys(leaves))
        except DonationError:
            labels = leaf_labels(self._spec, treedef, static)
            donated = [label for label, leaf in zip(labels, leaves) if is_donated(leaf)]
            raise DonationError(
                f"{self.name}: argument {', '.join(donated[:5])} was donated to an earlier call and can no longer be "
                "used; pass the value that call returned"
            ) from None

    def _lower_from(
        self, leaves: list[Any], treedef: Any, static: tuple, key: Any, _reference: tuple | None = None,
        miss: bool = True,
    ) -> Lowered:
        """Trace and lower one signature. `_reference = (traced graph, its out_info, format)`: lower that copy of
        the signature's trace with the exchange guard's reference format instead of `grad_exchange`. `miss=False`:
        a signature already compiled, traced again for `lower()`: neither explained nor counted by trace_count()."""
        spec = self._spec
        labels = leaf_labels(spec, treedef, static)
        for label, leaf in zip(labels, leaves):
            if is_donated(leaf):
                raise DonationError(
                    f"{self.name}: argument {label} was donated to an earlier call and can no longer be used; "
                    "pass the value that call returned"
                )
        descriptions = [describe_leaf(leaf) for leaf in leaves]
        if config.explain_cache_misses and _reference is None and miss and _first_rank():
            self._explain_miss(labels, descriptions, treedef, static, key)
        owner = leaf_argument(spec, treedef, static)
        donated_leaves = [
            i
            for i, arg in enumerate(owner)
            if (arg in spec.donate_argnums if isinstance(arg, int) else arg in spec.donate_argnames)
            and isinstance(leaves[i], torch.Tensor)
        ]
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        device = _local(tensors[0]).device if tensors else torch.device("cpu")
        kinds, scalar_dtypes, graph_input_leaves, example_inputs = [], {}, [], []
        dtensor_in: dict[int, lower.DTensorMeta] = {}
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, DTensor):
                kinds.append("dtensor")
                dtensor_in[i] = lower.DTensorMeta.of(leaf)
                example_inputs.append(leaf._local_tensor.detach())
            elif isinstance(leaf, torch.Tensor):
                kinds.append("tensor")
                example_inputs.append(leaf.detach())
            elif isinstance(leaf, SCALAR_TYPES):
                kinds.append("scalar")
                dtype = (
                    torch.bool
                    if isinstance(leaf, bool)
                    else (torch.int64 if isinstance(leaf, int) else torch.get_default_dtype())
                )
                scalar_dtypes[i] = dtype
                example_inputs.append(scalar_tensor(leaf, dtype, device, labels[i], self.name))
            else:
                kinds.append("static")
                continue
            graph_input_leaves.append(i)

        out_info: dict[str, Any] = {}
        fn = self.fn
        out_shardings = self.out_shardings

        def flat_fn(*graph_inputs: torch.Tensor) -> list[torch.Tensor]:
            call_leaves = list(leaves)
            for i, value in zip(graph_input_leaves, graph_inputs):
                meta = dtensor_in.get(i)
                call_leaves[i] = value if meta is None else lower.wrap_input(value, meta, labels[i])
            args, kwargs = rebuild_call(treedef, static, call_leaves)
            # A tensor the step creates itself (a mask, positions, a constant) is the same on every rank: it
            # meets the sharded inputs as a replicated value, as a constant in a JAX jit does (DTensor refuses
            # plain tensors beside DTensors otherwise). Lookups into a row-sharded table are lowered by pt3func.
            # Without DTensor inputs, a sharded value still arises from a shard_map or device_put in the step: under a
            # current mesh the step is traced as a sharded one; else (a shard_map given mesh=) plain tensors are at
            # least taken as replicated beside it, a flag of DTensor's dispatch that a plain program never reads.
            with _sharded_tracing() if dtensor_in or get_mesh() is not None else implicit_replication():
                out = fn(*args, **kwargs)
            out_leaves, out_treedef = tree.flatten(out)
            while tree.adopt_torch_nodes(out_leaves):  # a Hugging Face ModelOutput: its tensors are outputs
                out_leaves, out_treedef = tree.flatten(out)
            _refuse_opaque_outputs(self.name, out_leaves, out_treedef)
            out_info["treedef"] = out_treedef
            out_info["leaves"] = out_leaves
            out_info["call_leaves"] = call_leaves
            preferred = _preferred_outputs(spec, treedef, static, out_treedef)
            out_specs = _out_sharding_leaves(out_shardings, out, out_treedef)
            paths = _paths_of(out_treedef)
            dtensor_out: dict[int, lower.DTensorMeta] = {}
            plain_out: dict[int, Any] = {}
            flat_out = []
            for j, leaf in enumerate(out_leaves):
                if isinstance(leaf, DTensor):
                    if out_specs[j] is not None:
                        target = lower.output_placements(leaf, out_specs[j], paths[j])
                    elif preferred.get(j) in dtensor_in:
                        target = dtensor_in[preferred[j]].placements  # a donated state keeps its layout
                    else:
                        target = lower.resolve_partial(leaf)
                    if tuple(leaf.placements) != tuple(target):
                        with lower.reason(f"out_shardings of out{tree.keystr(paths[j])}"):
                            leaf = leaf.redistribute(leaf.device_mesh, target)
                    dtensor_out[j] = lower.DTensorMeta.of(leaf)
                    flat_out.append(leaf.to_local())
                elif isinstance(leaf, torch.Tensor):
                    if out_specs[j] is not None:  # placed after each call; checked against its shape now
                        plain_out[j] = lower.plain_output_sharding(leaf, out_specs[j], paths[j])
                    flat_out.append(leaf)
            out_info["dtensor_out"] = dtensor_out
            out_info["plain_out"] = plain_out
            out_info["preferred"] = preferred
            return flat_out

        # The lock covers lowering() too: its preserve_node_meta flag is process-global, and a virtual mesh's rank
        # threads leaving it mid-trace of another rank would drop that rank's node meta (reasons, remat regions).
        if _reference is None:
            with capture.TRACE_LOCK, lower.lowering(), recording_called_modules() as recording:
                try:
                    gm = capture.trace(flat_fn, example_inputs, self.name)
                except DataDependentControlFlowError as exc:
                    scalars = [label for label, kind in zip(labels, kinds) if kind == "scalar"]
                    if not scalars:
                        raise
                    raise DataDependentControlFlowError(
                        f"{exc} Python numbers among the arguments ({', '.join(scalars)}) are traced as 0-d tensors "
                        "(a new value does not retrace), so using one as a size, slice bound, range() or "
                        "condition is such a read: make it static (static_argnums / static_argnames)."
                    ) from None
            watch = self._watch(key, recording)
            modules = (watch, watch.modes())  # as the trace saw them (`_watched_key`)
        else:
            gm = _reference[0]
            out_info.update(_reference[1])
            modules = (NO_WATCH, ())  # the exchange guard's reference program: run by the Compiled it guards
        graph_labels = [labels[i] for i in graph_input_leaves]
        capture.check_no_input_mutation(gm, graph_labels, self.name)
        guard = None if _reference is not None else guard_for(self.exchange_guard, self.grad_exchange)
        if guard is not None and not grad_exchange.gradient_reductions(gm):
            guard = None  # nothing to compress: both programs would be the same
        untouched = copy_program(gm) if guard is not None else None
        if _reference is not None:
            # No state binding: the reference format keeps none, so the ExchangeState goes out as it came in.
            gm = forward_unchanged_inputs(grad_exchange.rewrite(gm, _reference[2], None, name=self.name))
        elif self.grad_exchange is not None:
            gm = _rewrite_grad_exchange(self.name, gm, self.grad_exchange, treedef, out_info, graph_input_leaves)
        elif grad_exchange.has_state(treedef):
            log.warning("%s: the step takes an ExchangeState but pf.jit(grad_exchange=...) is not set: gradients "
                        "are reduced uncompressed and the state comes back unchanged", self.name)
        # Remat before donation: it reasons about a pure graph (donation's in-place copies come last).
        gm = rematerialize(gm)
        if self.memory_budget is not None:
            gm = fit_memory_budget(gm, float(self.memory_budget))
        if self.backend == "inductor":
            gm = fence_recomputation(gm)  # else Inductor fuses recomputation back into the forward

        out_treedef = out_info["treedef"]
        out_leaves = out_info["leaves"]
        dtensor_out = out_info["dtensor_out"]
        out_labels = ["out" + tree.keystr(path) for path in _paths_of(out_treedef)]
        tensor_out = [j for j, leaf in enumerate(out_leaves) if isinstance(leaf, torch.Tensor)]
        constants = {j: leaf for j, leaf in enumerate(out_leaves) if not isinstance(leaf, torch.Tensor)}

        # Donation is planned in graph-index space, then mapped back to leaf indices for the program.
        in_meta = [_meta(labels[i], leaves[i], dtensor_in.get(i)) for i in graph_input_leaves]
        out_vals = [n.meta.get("val") for n in next(n for n in gm.graph.nodes if n.op == "output").args[0]]
        out_meta = [
            _out_meta(out_labels[j], v, dtensor_out.get(j)) if isinstance(v, torch.Tensor) else None
            for j, v in zip(tensor_out, out_vals)
        ]
        graph_in = {leaf: g for g, leaf in enumerate(graph_input_leaves)}
        graph_out = {leaf: g for g, leaf in enumerate(tensor_out)}
        preferred = {
            graph_in[i]: graph_out[j] for j, i in out_info["preferred"].items() if i in graph_in and j in graph_out
        }
        _check_donated_layouts(self.name, preferred, in_meta, out_meta, {graph_in[i] for i in donated_leaves})
        overlapping = {graph_in[i] for i in donated_leaves if _overlaps_itself(leaves[i])}
        donated_graph = [graph_in[i] for i in donated_leaves if graph_in[i] not in overlapping]
        plan_g = plan_donation(in_meta, out_meta, donated_graph, preferred)
        for g in overlapping:  # one address holds several elements: no output can be written into it
            plan_g.unused[g] = "its elements share memory (an expand()-ed view, stride 0): it cannot hold an output"
        gm = apply_donation(gm, plan_g)
        optimisations = [merge_duplicate_collectives, cast_before_gather]  # same values, fewer bytes: safe op by op
        if self.backend == "inductor":
            # Only where the compiler owns buffer lifetimes: run op by op, Python frees a collective's input
            # after its last use in the graph, which may be while a collective still in flight reads it.
            optimisations += [
                chunk_cross_entropy,  # the loss head a block of rows at a time: no whole logits
                bucket_gradient_all_reduces,
                issue_collectives_early,
                sink_waits,
                order_by_readiness,
            ]
        if self.backend == "inductor" and config.fence_backward_ops:
            optimisations.append(_backward_fence(config.fence_backward_ops))
        for optimisation in optimisations:
            if optimisation.__name__ not in config.disabled_passes:
                gm = optimisation(gm)
        plan = type(plan_g)(
            aliases={tensor_out[j]: graph_input_leaves[i] for j, i in plan_g.aliases.items()},
            unused={graph_input_leaves[i]: why for i, why in plan_g.unused.items()},
        )
        graph_output_leaves = [j for k, j in enumerate(tensor_out) if k not in plan_g.aliases]
        program = Program(
            name=self.name,
            graph_module=gm,
            treedef=treedef,
            static=key[1],
            input_labels=labels,
            input_leaf_kind=kinds,
            scalar_dtypes=scalar_dtypes,
            graph_input_leaves=graph_input_leaves,
            out_treedef=out_treedef,
            out_labels=out_labels,
            out_constants=constants,
            graph_output_leaves=graph_output_leaves,
            donation=plan,
            donated_leaves=donated_leaves,
            backend=self.backend,
            cuda_graphs=self.cuda_graphs,
            scalar_device=device,
            spec=spec,
            # The signature `Compiled.__call__` checks (without the current mesh: it places plain arguments on the
            # mesh the step was lowered under), and the rest of it, which it checks too.
            key=(*key[:2], key[2][:-1], key[3]),
            orders=key[4],
            static_modes=key[5],
            modules=modules,
            dtensor_out=dtensor_out,
            plain_out_shardings=out_info["plain_out"],
            notes={**lower.collective_notes(gm), **remat_notes(gm)},
        )
        lowered = Lowered(program, example_inputs)
        if _reference is not None:
            lowered._example_inputs = None  # compiled on the guard's second call: do not keep the first batch alive
            return lowered
        lowered._watch = watch
        self._drop_when_modules_die(leaves, static)
        if miss and _first_rank():  # a virtual mesh's rank threads trace alike: counted (and explained) once
            self._traces += 1
            self._last_seen = (treedef, labels, descriptions, _watched_key(key, lowered))
            self._warn_many_signatures()
        if guard is not None:
            reference = self._lower_from(leaves, treedef, static, key, (untouched, out_info, guard.reference))
            mesh = next((meta.device_mesh for meta in dtensor_in.values()), None)
            lowered._make_switch = functools.partial(
                ExchangeSwitch, guard, self.name, self.grad_exchange,
                reference=reference.compile, device=device, mesh=mesh,
            )
        return lowered


def _rewrite_grad_exchange(
    name: str, gm: Any, fmt: Format, treedef: Any, out_info: dict[str, Any], graph_input_leaves: list[int]
) -> Any:
    """Compress every gradient reduction (passes/grad_exchange.py), wiring in the step's ExchangeState."""
    source = {id(leaf): i for i, leaf in enumerate(out_info["call_leaves"]) if isinstance(leaf, torch.Tensor)}
    out_leaves = out_info["leaves"]
    out_source = {j: source[id(leaf)] for j, leaf in enumerate(out_leaves) if id(leaf) in source}
    tensor_out = [j for j, leaf in enumerate(out_leaves) if isinstance(leaf, torch.Tensor)]
    binding = grad_exchange.bind(name, treedef, out_info["treedef"], out_source, graph_input_leaves, tensor_out)
    grad_exchange.check_format(name, fmt, binding)
    return grad_exchange.rewrite(gm, fmt, binding, name=name)


def _backward_fence(setting: Any) -> Callable[[Any], Any]:
    """The backward-fence pass for `config.fence_backward_ops` (True: every op; names: those), named as the pass
    so that `config.disabled_passes` still finds it."""
    ops = None if setting is True else [backward_op(name) for name in sorted(setting)]

    def keep_backward_in_backward_pass(gm: Any) -> Any:
        return keep_backward_in_backward(gm, ops)

    keep_backward_in_backward_pass.__name__ = keep_backward_in_backward.__name__
    return keep_backward_in_backward_pass


# A jitted method of an instance (`net.forward`), as a bound method: its call, `lower` and `trace_count` are the
# Jitted's with the instance first (a plain bound method forwarded `.lower(x)` to the Jitted without it). Its
# `__doc__` is the method's, as a bound method's is.
class BoundJitted:
    __slots__ = ("__func__", "__self__")

    def __init__(self, jitted: Jitted, obj: Any):
        self.__func__ = jitted
        self.__self__ = obj

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Trace and lower for the instance and these arguments (nothing is run, nothing is donated)."""
        return self.__func__.lower(self.__self__, *args, **kwargs)

    def clear_cache(self) -> None:
        """The jitted function's `clear_cache()`: drops its programs, those of every instance."""
        self.__func__.clear_cache()

    def __getattr__(self, name: str) -> Any:  # trace_count, exchange_decision, name, fn, __name__, ...
        if name in ("__func__", "__self__"):  # (not set yet: a half-built copy)
            raise AttributeError(name)
        return getattr(self.__func__, name)

    @property
    def __doc__(self) -> str | None:  # type: ignore[override]
        return self.__func__.__doc__

    @property
    def __signature__(self) -> inspect.Signature:
        """The method's signature without `self`, as `inspect.signature` gives for a bound method."""
        sig = inspect.signature(self.__func__)
        return sig.replace(parameters=list(sig.parameters.values())[1:])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BoundJitted) and self.__func__ is other.__func__ and self.__self__ is other.__self__

    def __hash__(self) -> int:
        return hash((self.__func__, id(self.__self__)))

    def __repr__(self) -> str:
        return f"<bound pf.jit method {self.__func__.__qualname__} of {self.__self__!r}>"

    def __reduce__(self) -> Any:
        # As a bound method pickles: the instance's attribute of that name (the unpickled instance's own method).
        return getattr, (self.__self__, self.__func__.__name__)

    def __copy__(self) -> BoundJitted:
        return self

    def __deepcopy__(self, memo: dict) -> BoundJitted:
        # As `copy.deepcopy` copies a bound method: the same function, bound to a copy of the instance.
        return BoundJitted(self.__func__, copy.deepcopy(self.__self__, memo))


def _rebuild(fn: Callable[..., Any], options: dict[str, Any]) -> Jitted:
    """An unpickled `Jitted` (see `Jitted.__reduce__`)."""
    return Jitted(fn, **options)


def _named_global(jitted: Jitted) -> bool:
    """`jitted` is what its module's global of its qualified name holds (a module-level `@pf.jit def f`, or a
    class's jitted method): pickle finds it again by name."""
    name = getattr(jitted, "__qualname__", None)
    found: Any = sys.modules.get(getattr(jitted, "__module__", None) or "")
    if name is None or found is None or "<" in name:
        return False
    for part in name.split("."):
        found = getattr(found, part, None)
    return found is jitted


# A virtual call's rank thread: .donated, the caller's call's {leaf index: program} of its donated plain tensors.
_RANK_CALL = threading.local()
# Per Jitted, per signature: the lock its first call traces and compiles under (`Jitted._signature_lock`). Weak: a
# dropped Jitted drops its locks.
_SIGNATURE_LOCKS: weakref.WeakKeyDictionary[Jitted, dict[tuple, Any]] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()
# What `Jitted._last_seen` holds after `clear_cache()`: the next trace's explanation says so.
_CLEARED: Any = ("cleared",)
# How many programs one jitted function holds when it logs that it keeps tracing again (`_warn_many_signatures`).
_MANY_SIGNATURES = 64


def _module_died(jitted_ref: weakref.ref, module_id: int, ref: weakref.ref) -> None:
    """A weakref callback: a module that keyed signatures of the Jitted `jitted_ref` names died; drop them."""
    jitted = jitted_ref()
    if jitted is None:
        return
    if jitted._module_refs.get(module_id) is ref:
        jitted._module_refs.pop(module_id, None)
    jitted._drop(lambda k: names_dead_module(k[1], k[3]))


def _locks_after_fork() -> None:
    """In a forked child only the forking thread lives on: a lock another thread of the parent held (compiling a
    signature) would stay held forever, and the child's first call of that signature would hang."""
    global _SIGNATURE_LOCKS, _LOCKS_GUARD
    _SIGNATURE_LOCKS = weakref.WeakKeyDictionary()
    _LOCKS_GUARD = threading.Lock()


if hasattr(os, "register_at_fork"):  # (not on Windows)
    os.register_at_fork(after_in_child=_locks_after_fork)


def _budget_fraction(memory_budget: Any) -> float | None:
    """`memory_budget` as a float in [0, 1] (any real number type: numpy, a 0-d tensor), or None."""
    if memory_budget is None:
        return None
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (numbers.Real, torch.Tensor)):
        raise TypeError(
            f"pf.jit: memory_budget must be a number in [0, 1] or None, got {type(memory_budget).__name__} "
            f"{memory_budget!r}"
        )
    if isinstance(memory_budget, torch.Tensor) and (memory_budget.numel() != 1 or memory_budget.dtype == torch.bool):
        raise TypeError(f"pf.jit: memory_budget must be a number in [0, 1] or None, got a tensor {memory_budget!r}")
    fraction = float(memory_budget)
    if not 0.0 <= fraction <= 1.0:  # NaN fails this too
        raise ValueError(f"pf.jit: memory_budget must be in [0, 1] or None, got {fraction}")
    return fraction


def _any_functorch_wrapped(x: Any) -> bool:
    """Any tensor batched or differentiated by a torch.func transform applied around the call."""
    return any(
        isinstance(leaf, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(leaf)
        for leaf in tree.leaves(x)
    )


def _watched_key(key: tuple, lowered: Lowered) -> tuple:
    """`key` with the modes of the modules `lowered`'s trace called, as they are now (as it was traced)."""
    watch = lowered._watch
    return key[:6] + ((watch, watch.modes()),)


def _snapshot(program: Program) -> tuple[Any, dict]:
    """A copy of `program`'s graph module and its notes (keyed by the copy's nodes, found by name)."""
    graph_module = copy_program(program.graph_module)
    by_name = {node.name: node for node in graph_module.graph.nodes}
    notes = {by_name[node.name]: note for node, note in program.notes.items() if node.name in by_name}
    return graph_module, notes


def _name_of(fn: Any) -> str:
    """The function's name for logs and errors: a `functools.partial` by its function (its repr prints the bound
    arguments' values: a tensor's)."""
    if isinstance(fn, functools.partial):
        return f"partial({_name_of(fn.func)})"
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _first_rank() -> bool:
    """Outside a virtual mesh's rank threads, or in rank 0's."""
    return not in_rank_thread() or torch.distributed.get_rank() == 0


def _static_hashes(static: tuple, leaves: list[Any], compiled: Compiled) -> Any:
    """The hashes of a call's static arguments and static leaves (a new object, equal to none, where one is
    unhashable). The fast path of `Jitted._key` compares them with `==` to the last call's, which is the very same
    object for a static config passed again: equal to itself even after a change (`cfg.n = 4` on a value-hashed
    dataclass), where the cache's lookup (by hash) retraces. So its hash, the value's, is compared too (JAX hashes
    static arguments at every call)."""
    try:
        if not compiled._static_leaves:
            return hash(static)
        return (hash(static), *[hash(leaves[i]) for i in compiled._static_leaves])
    except TypeError:  # now unhashable (a field set to a list): never equal, so the slow path names it
        return object()


def _any_requires_grad(leaves: list[Any]) -> bool:
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            return True
    return False


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _local(x: torch.Tensor) -> torch.Tensor:
    return x._local_tensor if isinstance(x, DTensor) else x


def _meta(label: str, leaf: Any, dmeta: lower.DTensorMeta | None = None) -> LeafMeta:
    if isinstance(leaf, torch.Tensor):
        local = _local(leaf)
        layout = (dmeta.device_mesh, dmeta.placements) if dmeta is not None else None
        return LeafMeta(label, tuple(local.shape), local.dtype, local.device, layout)
    return LeafMeta(label, (), torch.get_default_dtype(), torch.device("cpu"))


def _out_meta(label: str, val: torch.Tensor, dmeta: lower.DTensorMeta | None) -> LeafMeta:
    layout = (dmeta.device_mesh, dmeta.placements) if dmeta is not None else None
    return LeafMeta(label, tuple(val.shape), val.dtype, val.device, layout)


def _overlaps_itself(leaf: torch.Tensor) -> bool:
    return torch._debug_has_internal_overlap(_local(leaf)) == 1  # 1: a stride-0 dim of size > 1 (2: cannot tell)


def _check_donated_layouts(
    name: str, preferred: dict[int, int], inputs: list[LeafMeta], outputs: list[LeafMeta | None], donated: set[int]
) -> None:
    """A donated sharded input whose own output comes back in another sharding cannot share its buffer."""
    for i, j in preferred.items():
        out = outputs[j]
        if i in donated and out is not None and inputs[i].layout != out.layout and inputs[i].layout is not None:
            raise ShardingError(
                f"{name}: donated input {inputs[i].path} (local shape {tuple(inputs[i].shape)} on mesh "
                f"{inputs[i].layout[0]}) has placements {inputs[i].layout[1]} but its output {out.path} (local shape "
                f"{tuple(out.shape)}) is asked to be {out.layout[1] if out.layout else 'a plain tensor'}; a buffer "
                "can only be reused by an output with the same sharding. Make out_shardings match in_shardings for "
                "donated state, or do not donate it."
            )


def _paths_of(treedef: Any) -> list[tuple[Any, ...]]:
    return tree.paths(tree.unflatten(treedef, [0] * treedef.num_leaves))


def _out_sharding_leaves(out_shardings: Any, out: Any, out_treedef: Any) -> list[Any]:
    """One `out_shardings` entry (NamedSharding, P or None) per output leaf."""
    if out_shardings is None:
        return [None] * out_treedef.num_leaves
    from pt3func.sharding.put import broadcast_shardings

    # Checked first on the output's skeleton (its paths as leaves): a mismatch message formats the value, and
    # formatting traced tensors raised the print guard's ImpureFunctionError, blaming collections' repr.
    skeleton = tree.unflatten(out_treedef, ["out" + tree.keystr(p) for p in _paths_of(out_treedef)])
    try:
        broadcast_shardings(skeleton, out_shardings)
    except ShardingError as exc:
        raise ShardingError(
            f"out_shardings {out_shardings!r} does not fit the step's output {skeleton!r}: {exc}"
        ) from None
    paths, _leaves, per_leaf, _treedef = broadcast_shardings(out, out_shardings)
    for path, s in zip(paths, per_leaf):
        if s is not None and not isinstance(s, (PartitionSpec, NamedSharding)):
            # A str there was read as a sequence of one-letter axes (P('d', 'p') for "dp").
            hint = f"; write P({s!r})" if isinstance(s, str) else ""
            raise ShardingError(f"out_shardings of out{tree.keystr(path)}: a sharding is P(...), pf.NamedSharding or "
                                f"None, got {type(s).__name__} {s!r}{hint}")
    return [s for s, leaf in zip(per_leaf, _leaves) if leaf is not None]


def _refuse_tensor_statics(name: str, static: tuple) -> None:
    """A tensor given as a static argument would key the cache by its identity and be baked into the program as
    a constant: refused, as JAX refuses an array there."""
    static_pos, static_kw = static
    for where, value in (*static_pos, *static_kw):
        if any(isinstance(x, torch.Tensor) for x in tree.leaves(value)):
            label = f"argument {where}" if isinstance(where, int) else f"argument {where!r}"
            raise TracingError(
                f"{name}: static {label} holds a tensor; static values key the compile cache and become "
                "constants of the program. Pass tensors as ordinary (traced) arguments."
            )


def _refuse_opaque_outputs(name: str, out_leaves: list[Any], out_treedef: Any) -> None:
    """An output leaf that is an object holding tensors (a dataclass, a Hugging Face cache, any class that is not a
    pytree node) would come back holding the trace's placeholder tensors, not the step's results: refused."""
    for j, leaf in enumerate(out_leaves):
        if isinstance(leaf, (torch.Tensor, bool, int, float, complex, str, type(None))):
            continue
        held = _tensor_attributes(leaf)
        if held:
            path = tree.keystr(_paths_of(out_treedef)[j]) or " (the whole output)"
            raise TracingError(
                f"{name}: output{path} is a {type(leaf).__qualname__} holding tensors ({', '.join(held)}), which is "
                "not a pytree node, so its tensors would not be the step's results. Return its tensors in a "
                "dict / tuple / namedtuple, register the class with pf.tree.register_node, or leave it out (a "
                "Hugging Face model's cache: use_cache=False)."
            )


def _tensor_attributes(obj: Any, depth: int = 3) -> list[str]:
    """The attributes of `obj` through which a tensor is reached (lists, dicts and objects `depth` deep)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: getattr(obj, f.name, None) for f in dataclasses.fields(obj)}
    else:
        fields = vars(obj) if hasattr(obj, "__dict__") and not isinstance(obj, type) else {}
    return [k for k, v in fields.items() if _reaches_tensor(v, depth)]


def _reaches_tensor(value: Any, depth: int) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if depth <= 0 or isinstance(value, (bool, int, float, complex, str, bytes, type(None), type)):
        return False
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_reaches_tensor(v, depth - 1) for v in value)
    if isinstance(value, dict):
        return any(_reaches_tensor(v, depth - 1) for v in value.values())
    return bool(_tensor_attributes(value, depth - 1))


def _preferred_outputs(spec: ArgSpec, treedef: Any, static: tuple, out_treedef: Any) -> dict[int, int]:
    """Donated positional argument k prefers output element k when both have the same structure.

    That is the usual `params, opt_state, ... = step(params, opt_state, ...)` shape; returns a map from
    output leaf index to call leaf index.
    """
    skeleton_out = tree.unflatten(out_treedef, list(range(out_treedef.num_leaves)))
    if not isinstance(skeleton_out, (tuple, list)):
        skeleton_out = (skeleton_out,)
    dyn_args, dyn_kwargs = tree.unflatten(treedef, list(range(treedef.num_leaves)))
    static_idx = {i for i, _ in static[0]}
    positions = [i for i in range(len(dyn_args) + len(static_idx)) if i not in static_idx]
    preferred: dict[int, int] = {}
    # Keyword arguments by their parameter's position (`step(params=..., opt_state=...)`).
    by_position = [*zip(positions, dyn_args), *(
        (spec.param_names.index(name), sub) for name, sub in dyn_kwargs.items() if name in spec.param_names
    )]
    for pos, sub in by_position:
        if pos not in spec.donate_argnums or pos >= len(skeleton_out):
            continue
        target = skeleton_out[pos]
        if tree.structure(target) != tree.structure(sub):
            continue
        for in_leaf, out_leaf in zip(tree.leaves(sub), tree.leaves(target)):
            preferred[out_leaf] = in_leaf
    return preferred


def jit(
    fn: Callable[..., Any] | None = None,
    *,
    in_shardings: Any = None,
    out_shardings: Any = None,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    donate_argnames: str | Sequence[str] = (),
    grad_exchange: Any = None,
    exchange_guard: Any = "auto",
    memory_budget: float | None = None,
    backend: str = "inductor",
    cuda_graphs: bool = False,
) -> Any:
    """Trace `fn` (forward, backward, optimizer: the whole step) into one static program and compile it.

    Works as `pf.jit(f, ...)`, `@pf.jit` and `@functools.partial(pf.jit, donate_argnums=0)`. The program
    is traced once per input signature (pytree structure, shapes, dtypes, static values) and cached.
    Arguments that are Python scalars (bool, int, float) are traced as 0-d tensor inputs: a new value runs the
    same program (or, named in static_argnums / static_argnames, they are static: a new value traces again).
    Python values the step reads from anywhere else (closures, globals, module attributes: a global learning
    rate, `nn.Dropout.p`) are read once, when the step is traced, and become constants of the program, as in
    `jax.jit`: a later change is not seen. Pass such a value as an argument, or make a new `pf.jit`. The one
    exception is a module's `training` flag, which is part of the signature (`model.eval()` traces again).
    Donated arguments' buffers are reused for outputs of the same shape/dtype: the compiled program writes
    the new values into them in place, and the donated tensors become unreadable.
    `cuda_graphs=True` (CUDA inputs on one device) captures each compiled program in a CUDA graph after one
    warm-up call and replays it (see `pt3func.runtime.cudagraphs`; donate params and state with it).
    `grad_exchange=fmt` compresses every gradient reduction (`pf.compress`). `exchange_guard` ("auto": a
    `pf.compress.Guard()` for every format but bf16, fp16 and none; a `Guard`; or None) times the compressed
    program against a bf16-exchange one on the first calls and switches compression off, with a logged reason,
    where it costs more than 3% (see `pt3func.compress.guard`; `exchange_decision()` says what it decided).
    """
    options = dict(
        in_shardings=in_shardings,
        out_shardings=out_shardings,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        donate_argnums=donate_argnums,
        donate_argnames=donate_argnames,
        grad_exchange=grad_exchange,
        exchange_guard=exchange_guard,
        memory_budget=memory_budget,
        backend=backend,
        cuda_graphs=cuda_graphs,
    )
    if fn is None:
        return functools.partial(jit, **options)
    return Jitted(fn, **options)


@contextlib.contextmanager
def _sharded_tracing() -> Iterator[None]:
    """What a sharded step is traced under: plain tensors taken as replicated, some torch functions handled by
    pt3func (`spmd/overrides.py`)."""
    with implicit_replication(), ShardedTraceOverrides(), reducing_partial_sums(), decomposing_ops_without_rules():
        yield
