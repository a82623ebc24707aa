"""How a call's arguments become a program's inputs: static vs traced, donated or not, and the cache key."""

from __future__ import annotations

import functools
import inspect
import numbers
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pt3func import tree
from pt3func.errors import TracingError
from pt3func.runtime.virtual import in_rank_thread

SCALAR_TYPES = (bool, int, float)


def _normalize(nums: int | Sequence[int], nparams: int | None, what: str, fn_name: str) -> frozenset[int]:
    """`static_argnums` / `donate_argnums` as a set of non-negative ints; anything else raises, naming the option."""
    if _is_index(nums):
        nums = (nums,)
    elif isinstance(nums, (str, bytes)) or not isinstance(nums, (Sequence, set, frozenset)):
        raise ValueError(f"pf.jit({fn_name}): {what} must be an int or a sequence of ints, got {nums!r}")
    out = set()
    for n in nums:
        if not _is_index(n):
            hint = f" (a parameter name goes in {what.replace('nums', 'names')})" if isinstance(n, str) else ""
            raise ValueError(f"pf.jit({fn_name}): {what} must hold ints, got {n!r} in {nums!r}{hint}")
        n = int(n)
        if n < 0:
            if nparams is None:
                raise ValueError(f"pf.jit({fn_name}): negative {what} {n} needs a function with a known signature")
            if n < -nparams:  # as JAX: out of range, not wrapped around
                raise ValueError(
                    f"pf.jit({fn_name}): {what} {n} is out of range for a function of {nparams} positional arguments"
                )
            n += nparams
        out.add(n)
    return frozenset(out)


def _is_index(n: Any) -> bool:
    return isinstance(n, numbers.Integral) and not isinstance(n, bool)  # numpy ints too


def _short_name(fn: Any, attr: str = "__qualname__") -> str:
    """`fn`'s name for errors. Never its repr: a `functools.partial`'s prints its bound arguments (a tensor's
    values), a module's its whole architecture. A partial by its function, a module or callable object by its
    type."""
    if isinstance(fn, functools.partial):
        return f"partial({_short_name(fn.func, attr)})"
    name = getattr(fn, attr, None)
    if isinstance(name, str):
        return name
    return getattr(type(fn), attr, None) or type(fn).__name__


def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    """The signature a call of `fn` binds to. For an `nn.Module` that of its `forward` (bound: no `self`), not
    `nn.Module.__call__`'s `(*args, **kwargs)`, which would leave every parameter name unknown."""
    if isinstance(fn, torch.nn.Module) and type(fn).__call__ is torch.nn.Module.__call__:
        return inspect.signature(fn.forward)
    return inspect.signature(fn)


@dataclass(frozen=True)
class ArgSpec:
    """Which positional indices / keyword names are static and which are donated."""

    static_argnums: frozenset[int]
    static_argnames: frozenset[str]
    donate_argnums: frozenset[int]
    donate_argnames: frozenset[str]
    param_names: tuple[str, ...]
    # Takes **kwargs (or has no signature to tell): the order of its keyword arguments may matter (it may iterate
    # them), so it is part of the jit signature.
    var_keyword: bool = True
    name: str = ""  # the function's short name, for errors
    varargs: str = ""  # the name of its *args parameter, if any: leaves past the named positions are labelled by it

    @classmethod
    def build(
        cls,
        fn: Callable[..., Any],
        static_argnums: int | Sequence[int],
        static_argnames: str | Sequence[str],
        donate_argnums: int | Sequence[int],
        donate_argnames: str | Sequence[str],
    ) -> ArgSpec:
        try:
            every = list(_signature(fn).parameters.values())
        except (TypeError, ValueError):
            every = None
        params = None if every is None else [
            p for p in every if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        var_positional = every is None or any(p.kind == p.VAR_POSITIONAL for p in every)
        varargs = next((p.name for p in every or () if p.kind == p.VAR_POSITIONAL), "")
        var_keyword = every is None or any(p.kind == p.VAR_KEYWORD for p in every)
        names = tuple(p.name for p in params) if params is not None else ()
        positional = [p.name for p in params if p.kind != p.KEYWORD_ONLY] if params is not None else []
        nparams = len(positional) if params is not None else None
        fn_name = _short_name(fn)
        short = _short_name(fn, "__name__")
        s_nums = set(_normalize(static_argnums, nparams, "static_argnums", fn_name))
        d_nums = set(_normalize(donate_argnums, nparams, "donate_argnums", fn_name))
        if nparams is not None and not var_positional:
            for what, nums in (("static_argnums", s_nums), ("donate_argnums", d_nums)):
                beyond = sorted(n for n in nums if n >= nparams)
                if beyond:  # as in JAX: a silently ignored index would trace the argument (or never donate it)
                    raise ValueError(
                        f"{what}={beyond} but {short} takes {nparams} positional arguments "
                        f"({', '.join(positional)})"
                    )
        s_names = {static_argnames} if isinstance(static_argnames, str) else set(static_argnames)
        d_names = {donate_argnames} if isinstance(donate_argnames, str) else set(donate_argnames)
        # As in JAX: a name given by position is also static/donated when passed by keyword, and vice versa.
        for nums, nameset in ((s_nums, s_names), (d_nums, d_names)):
            for i in list(nums):
                if i < len(positional):
                    nameset.add(positional[i])
            for name in list(nameset):
                if name in positional:
                    nums.add(positional.index(name))
                elif params is not None and name not in names and not var_keyword:
                    # With **kwargs any name may be passed (as JAX allows): static / donated when it is.
                    raise ValueError(f"{short} has no parameter named {name!r}")
        both = (s_nums & d_nums) | (s_names & d_names)
        if both:
            raise ValueError(f"arguments {sorted(map(str, both))} cannot be both static and donated")
        return cls(
            frozenset(s_nums), frozenset(s_names), frozenset(d_nums), frozenset(d_names), tuple(positional),
            var_keyword, short, varargs,
        )

    def arg_label(self, where: Any) -> str:
        """`params` for positional 0 of `train_step(params, ...)`, `rest[1]` for positional 2 of `f(x, *rest)`,
        else `args[0]` (no signature to tell) / the keyword."""
        if isinstance(where, int):
            if where < len(self.param_names):
                return self.param_names[where]
            if self.varargs:
                return f"{self.varargs}[{where - len(self.param_names)}]"
            return f"args[{where}]"
        return str(where)


def split_call(spec: ArgSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any, tuple]:
    """Return `(leaves, treedef, static)` for a call; `static` is hashable and part of the cache key."""
    dynamic, static = split_static(spec, args, kwargs)
    leaves, treedef = tree.flatten(dynamic)
    return leaves, treedef, static


def static_types(static: tuple) -> tuple:
    """What else decides the program besides the leaves: the types of the static values, inside containers too
    (`2` and `2.0`, `Cfg(2)` and `Cfg(2.0)` are equal and hash alike but trace different programs), and the global
    modes a trace reads (`torch.autocast`, `torch.inference_mode`, the default dtype): a program traced under
    autocast casts its matmuls, one traced outside does not."""
    modes = trace_modes()
    static_pos, static_kw = static
    if not static_pos and not static_kw:
        return modes
    return modes + tuple(_types_of(v) for _, v in (*static_pos, *static_kw))


def _types_of(value: Any) -> Any:
    leaves = tree.leaves(value)
    if len(leaves) == 1 and leaves[0] is value:
        return type(value)
    return (type(value), tuple(type(leaf) for leaf in leaves))


def trace_modes() -> tuple:
    """The global modes that change what a step traces to: autocast per device type (with its dtype), inference
    mode, and `torch.set_default_dtype` where it is not float32 (`torch.ones(3)` in the step, a Python float
    argument's 0-d tensor take it). () when none is on, the common case."""
    modes: tuple = ()
    default_dtype = torch.get_default_dtype()
    if default_dtype is not torch.float32:  # float32 adds nothing: the keys of existing programs stay as they were
        modes += (("default_dtype", default_dtype),)
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            modes += ((device, torch.get_autocast_dtype(device)),)
    if torch.is_inference_mode_enabled():
        modes += ("inference_mode",)
    return modes


def split_static(spec: ArgSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, tuple]:
    """`((dynamic args, dynamic kwargs), static)` of a call: the pytree to flatten, and the static values."""
    if spec.static_argnums:
        static_pos = tuple((i, args[i]) for i in sorted(spec.static_argnums) if i < len(args))
        dyn_args = tuple(a for i, a in enumerate(args) if i not in spec.static_argnums)
    else:
        static_pos, dyn_args = (), args
    if kwargs:
        static_kw = tuple(sorted((k, v) for k, v in kwargs.items() if k in spec.static_argnames))
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in spec.static_argnames}
    else:
        static_kw, dyn_kwargs = (), kwargs
    return (dyn_args, dyn_kwargs), (static_pos, static_kw)


def leaf_key(leaf: Any) -> Any:
    """What about one leaf decides its program: tensor metadata, a scalar's type, or a static value."""
    if type(leaf) is torch.Tensor:  # the common case first: this runs for every leaf of every call
        shape = leaf.shape  # read once: a plain tensor's key is read for every leaf of every call
        return (shape, leaf.dtype, leaf.device, _layout(leaf, shape))
    if isinstance(leaf, torch.Tensor):
        placement = getattr(leaf, "placements", None)
        if placement is not None:
            mesh_id = _mesh_id(leaf.device_mesh)
            return (type(leaf), leaf.shape, leaf.dtype, mesh_id, placement, _layout(leaf._local_tensor))
        return (leaf.shape, leaf.dtype, leaf.device, _layout(leaf))
    if isinstance(leaf, SCALAR_TYPES):
        return type(leaf)
    if isinstance(leaf, torch.nn.Module):  # a jitted method's `self`: what it reads of itself includes its mode
        return ("static", ModuleKey(leaf), leaf.training)
    return ("static", leaf)


class ModuleKey:
    """A module in a jit signature (a jitted method's `self`, a module given as a static argument), as JAX's caches
    key bound objects (`weakref_lru_cache`): by identity, and held weakly. Held strongly, a class's jitted method kept
    every instance it was ever called on alive, with its parameters, for the life of the class. Equal only to a key
    of the same live module; once the module is gone, only to itself (its id may then name a new module)."""

    __slots__ = ("_ref", "_hash", "_type")

    def __init__(self, module: torch.nn.Module):
        self._ref = weakref.ref(module)
        self._hash = id(module)
        self._type = type(module)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not ModuleKey:
            return NotImplemented
        module = self._ref()
        return module is not None and module is other._ref()

    def __hash__(self) -> int:
        return self._hash

    def module(self) -> torch.nn.Module | None:
        """The module, or None once it is gone."""
        return self._ref()

    def describe(self) -> str:
        return f"{self._type.__name__} at {self._hash:#x}" + ("" if self._ref() is not None else " (gone)")

    def __repr__(self) -> str:
        module = self._ref()
        return repr(module) if module is not None else f"<{self.describe()}>"


def static_key(static: tuple) -> tuple:
    """`static` as a cache key holds it: each module given as a static argument by its `ModuleKey`, other values as
    they are (JAX keeps those too). A module inside a static container is held as the container holds it."""
    static_pos, static_kw = static
    if not static_pos and not static_kw:
        return static
    if not any(isinstance(v, torch.nn.Module) for _, v in (*static_pos, *static_kw)):
        return static
    return (
        tuple((i, ModuleKey(v) if isinstance(v, torch.nn.Module) else v) for i, v in static_pos),
        tuple((k, ModuleKey(v) if isinstance(v, torch.nn.Module) else v) for k, v in static_kw),
    )


def static_modules(leaves: Sequence[Any], static: tuple) -> list[torch.nn.Module]:
    """The modules a cache key holds by `ModuleKey`: module leaves and modules given as static arguments."""
    static_pos, static_kw = static
    found = [leaf for leaf in leaves if isinstance(leaf, torch.nn.Module)]
    return found + [v for _, v in (*static_pos, *static_kw) if isinstance(v, torch.nn.Module)]


def names_dead_module(static: tuple, leaf_keys: tuple) -> bool:
    """Whether a signature (its `static_key` and leaf keys) names a module that is gone: no call can match it again."""
    static_pos, static_kw = static
    for _, v in (*static_pos, *static_kw):
        if type(v) is ModuleKey and v.module() is None:
            return True
    for k in leaf_keys:
        if type(k) is tuple and len(k) == 3 and type(k[1]) is ModuleKey and k[1].module() is None:
            return True
    return False


# (DeviceMesh, its groups' names, the world) -> the first DeviceMesh seen with them. Kept alive: its id names that
# value in signatures (and a dead mesh's id could be reused by another mesh).
_MESH_BY_VALUE: dict[tuple, Any] = {}


def _mesh_id(device_mesh: Any) -> int:
    """The id a DTensor's mesh has in its signature. On a real world, that of the first equal mesh seen: copies
    of a mesh (`copy.deepcopy` or `torch.load` of a DTensor gives it a new DeviceMesh) run the programs traced on
    the original, not a new trace and compile per copy. Equal means the same ranks in the same layout, axis names
    and device type (DeviceMesh's ==), the same process groups by name (the names a program's collectives take)
    and the same world (group names are reused by a world started after one is destroyed). In a virtual mesh's
    rank thread, the mesh itself: equal-looking meshes of different virtual worlds are different programs."""
    if in_rank_thread():
        return id(device_mesh)
    value = (device_mesh, tuple(getattr(device_mesh, "_dim_group_names", None) or ()), dist.group.WORLD)
    return id(_MESH_BY_VALUE.setdefault(value, device_mesh))


def _layout(t: torch.Tensor, shape: torch.Size | None = None) -> tuple[int, ...]:
    """`t`'s strides, but 0 for every dim of size 1: such a stride never moves an address (PyTorch's contiguity and
    view rules, and Inductor's input asserts, ignore it). A row `[1, n]` split off a `[1, N]` buffer (stride N) and
    a fresh `[1, n]` (stride n) are then one signature, not a second trace and compile of the same program. An
    empty tensor has no addresses at all: () for any strides."""
    stride = t.stride()
    shape = t.shape if shape is None else shape
    if 0 in shape:
        return ()
    if 1 in shape:
        return tuple([0 if size == 1 else s for size, s in zip(shape, stride)])
    return stride


def describe_leaf(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        placement = getattr(leaf, "placements", None)
        text = f"{str(leaf.dtype).replace('torch.', '')}{list(leaf.shape)} on {leaf.device}"
        local = leaf._local_tensor if placement is not None else leaf
        if not local.is_contiguous():  # strides are part of the signature: name them where they are unusual
            text += f" strides={tuple(local.stride())}"
        return text + (f" placements={placement}" if placement is not None else "")
    if isinstance(leaf, SCALAR_TYPES):
        return f"Python {type(leaf).__name__} (traced)"
    return f"static {leaf!r}"


def describe_key(k: Any, strides: bool = False) -> str:
    """One leaf's signature key (`leaf_key`) in words: `float32[16, 8] on cpu`."""
    if isinstance(k, tuple) and len(k) == 6 and isinstance(k[0], type):  # a DTensor's
        _, shape, dtype, _, placements, layout = k
        text = f"{str(dtype).replace('torch.', '')}{list(shape)} placements={tuple(placements)}"
        return text + (f" strides={layout}" if strides else "")
    if isinstance(k, tuple) and len(k) == 4 and isinstance(k[0], torch.Size):
        shape, dtype, device, layout = k
        text = f"{str(dtype).replace('torch.', '')}{list(shape)} on {device}"
        return text + (f" strides={layout}" if strides else "")
    if isinstance(k, tuple) and len(k) == 2 and k[0] == "static":
        return f"static {k[1]!r}"
    if isinstance(k, tuple) and len(k) == 3 and k[0] == "static":  # a module, with its mode
        return f"{k[1].describe()} in {'train' if k[2] else 'eval'} mode"
    if isinstance(k, type):
        return f"Python {k.__name__} (traced)"
    return repr(k)


def leaf_key_changes(labels: list[str], old: tuple, new: tuple) -> list[str]:
    """`label: before -> after` for each leaf whose signature key differs, in words; the strides are named where
    nothing else differs, and "on another mesh" where not even they do (a signature names its mesh by `_mesh_id`)."""
    changes = []
    for label, a, b in zip(labels, old, new):
        if a != b:
            before, after = describe_key(a), describe_key(b)
            if before == after:
                before, after = describe_key(a, strides=True), describe_key(b, strides=True)
            changes.append(f"{label}: {before} -> {after}" + (" on another mesh" if before == after else ""))
    return changes


def module_mode_changes(labels: list[str], old: tuple, new: tuple) -> list[str]:
    """`the train / eval mode of module self (Net at 0x..) changed: train -> eval` for each module leaf (a jitted
    method's `self`) that is the same module in another mode: a mode change, not a new instance."""
    changes = []
    for label, a, b in zip(labels, old, new):
        if (type(a) is tuple and type(b) is tuple and len(a) == len(b) == 3 and a[0] == b[0] == "static"
                and type(a[1]) is ModuleKey and a[1] == b[1] and a[2] != b[2]):
            changes.append(f"the train / eval mode of module {label} ({b[1].describe()}) changed: "
                           f"{_mode_word(a[2])} -> {_mode_word(b[2])}")
    return changes


def _mode_word(training: bool) -> str:
    return "train" if training else "eval"


def _statics(spec: ArgSpec, static: tuple) -> dict[str, Any]:
    """A static key's values (`static_key`) by parameter name."""
    static_pos, static_kw = static
    return {**{spec.arg_label(i): v for i, v in static_pos}, **dict(static_kw)}


def _short_repr(value: Any) -> str:
    """A static value in a log line: a module as its own repr where that is one short line (`ReLU()`), by type and
    address otherwise (a network's repr is its whole architecture); any value cut at 80 characters."""
    if type(value) is ModuleKey:
        module = value.module()
        text = repr(module) if module is not None else ""
        if not text or "\n" in text or len(text) > 80:
            return value.describe()
        return text
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _type_name(value: Any) -> str:
    return value._type.__name__ if type(value) is ModuleKey else type(value).__name__


def static_changes(spec: ArgSpec, old: tuple, new: tuple) -> list[str]:
    """The static arguments that differ between two static keys (`static_key`), by parameter name: `static
    argument num_layers changed: 2 -> 3`; an equal-looking value that is another object (a new `nn.ReLU()`, an
    object without `__eq__`) is named as such, and a value of another type (`2` -> `2.0`) with its types."""
    before, after = _statics(spec, old), _statics(spec, new)
    changes = [f"static argument {label} now passed: {_short_repr(after[label])}" for label in after
               if label not in before]
    changes += [f"static argument {label} no longer passed" for label in before if label not in after]
    for label in [k for k in after if k in before]:
        a, b = before[label], after[label]
        try:
            same = type(a) is type(b) and bool(a == b)
        except Exception:  # noqa: BLE001 (an `==` that is no bool: the values decide nothing here)
            same = a is b
        if same:
            continue
        was, now = _short_repr(a), _short_repr(b)
        if was == now and _type_name(a) == _type_name(b):
            hint = ("a module is keyed by identity: pass the same object" if type(b) is ModuleKey
                    else "the two are not ==: pass the same object, or give the class __eq__ and __hash__")
            changes.append(f"static argument {label} changed: another instance of {_type_name(b)} (equal repr "
                           f"{now}); {hint}")
        elif _type_name(a) != _type_name(b):
            changes.append(f"static argument {label} changed: {_type_name(a)} {was} -> {_type_name(b)} {now}")
        else:
            changes.append(f"static argument {label} changed: {was} -> {now}")
    return changes


def static_module_mode_changes(spec: ArgSpec, static: tuple, old: tuple, new: tuple) -> list[str]:
    """Which module given as a static argument changed mode, from two `static_module_modes` of one static key."""
    names = [label for label, v in _statics(spec, static).items() if type(v) is ModuleKey]
    return [f"the train / eval mode of module {name} (a static argument) changed: {_mode_word(a)} -> {_mode_word(b)}"
            for name, a, b in zip(names, old, new) if a != b]


_LEAF = object()  # a leaf in the skeleton of a call's structure (`structure_changes`)


def structure_changes(spec: ArgSpec, old_treedef: Any, old_static: tuple, treedef: Any, static: tuple) -> list[str]:
    """Where two calls' argument structures differ, by path: `params['w_extra'] added`, `batch[2] removed`,
    `params['w3']: a leaf -> a tuple of 1`, `argument mask now passed`. [] where no path tells (the caller
    then shows the treedefs)."""
    try:
        before, after = _arguments(spec, old_treedef, old_static), _arguments(spec, treedef, static)
    except Exception:  # noqa: BLE001 (a registered node whose unflatten checks its children: no skeleton to walk)
        return []
    changes = [f"argument {label} now passed" for label in after if label not in before]
    changes += [f"argument {label} no longer passed" for label in before if label not in after]
    for label in [k for k in after if k in before]:
        _subtree_changes(label, before[label], after[label], changes)
    return changes


def _arguments(spec: ArgSpec, treedef: Any, static: tuple) -> dict[str, Any]:
    """Each dynamic argument of a call structure by its label, as a skeleton with `_LEAF` for every leaf."""
    dyn_args, dyn_kwargs = tree.unflatten(treedef, [_LEAF] * treedef.num_leaves)
    static_idx = {i for i, _ in static[0]}
    positions = [i for i in range(len(dyn_args) + len(static_idx)) if i not in static_idx]
    return {**{spec.arg_label(pos): sub for pos, sub in zip(positions, dyn_args)}, **dyn_kwargs}


def _subtree_changes(label: str, a: Any, b: Any, out: list[str]) -> None:
    if a is _LEAF and b is _LEAF:
        return
    if a is _LEAF or b is _LEAF or type(a) is not type(b):
        out.append(f"{label}: {_node_text(a)} -> {_node_text(b)}")
        return
    if isinstance(a, dict):
        out.extend(f"{label}[{k!r}] added" for k in b if k not in a)
        out.extend(f"{label}[{k!r}] removed" for k in a if k not in b)
        common = [k for k in b if k in a]
        if not any(k not in a for k in b) and not any(k not in b for k in a) and type(a) is not dict \
                and list(a) != list(b):  # an OrderedDict's order is part of its structure
            out.append(f"{label}: key order {list(a)} -> {list(b)}")
        for k in common:
            _subtree_changes(f"{label}[{k!r}]", a[k], b[k], out)
        return
    if type(a) in (list, tuple):
        out.extend(f"{label}[{i}] added" for i in range(len(a), len(b)))
        out.extend(f"{label}[{i}] removed" for i in range(len(b), len(a)))
        for i, (x, y) in enumerate(zip(a, b)):
            _subtree_changes(f"{label}[{i}]", x, y, out)
        return
    a_children, a_meta, a_entries, _ = _one_level(a)
    b_children, b_meta, b_entries, _ = _one_level(b)
    if len(a_children) != len(b_children) or list(a_entries) != list(b_entries) or not _same_meta(a_meta, b_meta):
        out.append(f"{label}: {_node_text(a)} -> {_node_text(b)}")
        return
    for entry, x, y in zip(b_entries, a_children, b_children):
        _subtree_changes(f"{label}[{entry!r}]", x, y, out)


def _one_level(node: Any) -> tuple:
    import optree

    return optree.tree_flatten_one_level(node, none_is_leaf=False, namespace=tree.NAMESPACE)


def _same_meta(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 (metadata whose `==` is no bool)
        return a is b


def _node_text(x: Any) -> str:
    """A skeleton node in words: `a leaf`, `None`, `a dict with keys ['a', 'b']`, `a tuple of 2`."""
    if x is _LEAF:
        return "a leaf"
    if x is None:
        return "None"
    name = type(x).__name__
    article = "an" if name[:1].lower() in "aeiou" else "a"
    if isinstance(x, dict):
        return f"{article} {name} with keys {list(x)}"
    if hasattr(x, "_fields"):
        return f"{article} {name} with fields {tuple(x._fields)}"
    if type(x) in (list, tuple):
        return f"a {name} of {len(x)}"
    return f"{article} {name}"


def leaf_labels(spec: ArgSpec, treedef: Any, static: tuple) -> list[str]:
    """A readable name per flat leaf: `params['fc1']['weight']`, `batch[0]`, `lr`."""
    (static_pos, _static_kw) = static
    static_idx = {i for i, _ in static_pos}
    skeleton = tree.unflatten(treedef, list(range(treedef.num_leaves)))
    dyn_args, dyn_kwargs = skeleton
    positions = [i for i in range(len(dyn_args) + len(static_idx)) if i not in static_idx]
    labels: list[str] = [""] * treedef.num_leaves
    for pos, sub in zip(positions, dyn_args):
        for path, idx in zip(tree.paths(sub), tree.leaves(sub)):
            labels[idx] = spec.arg_label(pos) + tree.keystr(path)
    for name, sub in dyn_kwargs.items():
        for path, idx in zip(tree.paths(sub), tree.leaves(sub)):
            labels[idx] = name + tree.keystr(path)
    return labels


def leaf_argument(spec: ArgSpec, treedef: Any, static: tuple) -> list[Any]:
    """The positional index (int) or keyword name (str) each flat leaf belongs to."""
    (static_pos, _static_kw) = static
    static_idx = {i for i, _ in static_pos}
    dyn_args, dyn_kwargs = tree.unflatten(treedef, list(range(treedef.num_leaves)))
    positions = [i for i in range(len(dyn_args) + len(static_idx)) if i not in static_idx]
    owner: list[Any] = [None] * treedef.num_leaves
    for pos, sub in zip(positions, dyn_args):
        for idx in tree.leaves(sub):
            owner[idx] = pos
    for name, sub in dyn_kwargs.items():
        for idx in tree.leaves(sub):
            owner[idx] = name
    return owner


def rebuild_call(treedef: Any, static: tuple, leaves: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Inverse of `split_call`: the `(args, kwargs)` to call the user's function with."""
    dyn_args, dyn_kwargs = tree.unflatten(treedef, leaves)
    static_pos, static_kw = static
    args = list(dyn_args)
    for i, value in static_pos:
        args.insert(i, value)
    kwargs = dict(dyn_kwargs)
    kwargs.update(static_kw)
    return tuple(args), kwargs


def check_hashable(
    static: tuple, labels_for_static: Callable[[], list[str]] | None = None, spec: ArgSpec | None = None
) -> None:
    """Raise naming each unhashable static argument (by parameter name where `spec` is given, and the function),
    with its value's type. `labels_for_static` is unused (kept for callers): the culprits are found here."""
    try:
        hash(static)
    except TypeError:
        pass
    else:
        return
    static_pos, static_kw = static
    bad = []
    for where, value in (*static_pos, *static_kw):
        try:
            hash(value)
        except TypeError as exc:
            label = spec.arg_label(where) if spec is not None else (f"args[{where}]" if isinstance(where, int)
                                                                     else str(where))
            bad.append(f"{label} ({exc})")
    who = f"{spec.name}: " if spec is not None and spec.name else ""
    raise TracingError(
        f"{who}static argument{'s' if len(bad) > 1 else ''} {', '.join(bad)} must be hashable (static arguments "
        "key the compile cache): pass a tuple for a list, a frozen dataclass, or make it a traced argument"
    ) from None
