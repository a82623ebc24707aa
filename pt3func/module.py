"""Turn an `nn.Module` into a pure function of a params pytree: `params, apply = functionalize(module)`."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from pt3func import tree

Path = tuple[str, ...]


def functionalize(module: nn.Module) -> tuple[dict[str, Any], Apply]:
    """Split `module` into a params pytree and a pure function that runs its forward.

    `params` is a nested dict mirroring the module, e.g. `{"blocks": {"0": {"qkv": {"weight": t}}}}`,
    holding every parameter and every buffer (persistent or not) under its attribute path. Leaves are
    plain tensors with `requires_grad=False`, made by `detach()`: they share storage with the module, so
    training the module in place afterwards also changes them (clone the tree to decouple it).
    A tensor tied under several names (GPT-2's `lm_head.weight` is `transformer.wte.weight`) appears once,
    under the name `named_parameters()` yields first; `apply` ties it again under every other name.

    `apply(params, *args, **kwargs)` runs `module(*args, **kwargs)` with the module's tensors replaced by
    those of `params` and returns its output. The module's own tensors and the tensors of `params` are
    never changed: buffers the forward updates in place (BatchNorm's running statistics) are copied first.
    `apply.with_updates(...)` returns `(output, new_params)` with those updates.
    The forward runs in the module's current mode: call `module.train()` or `module.eval()` to switch.
    Names are read once, here: parameters or buffers added to the module later are not seen.

    Args:
      module: any `nn.Module`, including Hugging Face models built from a config.

    Returns:
      `(params, apply)`.
    """
    params: dict[str, Any] = {}
    # remove_duplicate=True keeps the first name of each tied tensor; the others become aliases.
    kept = {id(t): name for name, t in module.named_parameters()}
    buffer_names = []
    for name, t in module.named_buffers():
        if id(t) not in kept:
            kept[id(t)] = name
            buffer_names.append(name)
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if kept.get(id(t)) == name:
            _insert(params, name, t.detach())
    aliases: dict[str, str] = {}
    for name, t in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        if kept[id(t)] != name:
            aliases[name] = kept[id(t)]
    frozen = frozenset(name for name, t in module.named_parameters() if not t.requires_grad)
    if frozen:
        warnings.warn(
            f"functionalize: {len(frozen)} parameters have requires_grad=False ({', '.join(sorted(frozen)[:3])}"
            f"{', ...' if len(frozen) > 3 else ''}); params holds them like any other, so pf.grad differentiates "
            "them and an optimizer updates them. To keep them frozen, split them off: trainable, frozen = "
            "apply.partition(params), differentiate `trainable` and call apply(apply.combine(trainable, frozen), ...)",
            stacklevel=2,
        )
    return params, Apply(module, params, frozenset(buffer_names), aliases, frozen)


class Apply:
    """The pure forward of a module: `apply(params, *args, **kwargs) -> output`.

    Made by `functionalize`. Attributes:
      module: the module whose forward runs (its tensors are swapped for `params` during a call only).
      param_paths: the pytree path (tuple of keys) of every parameter in `params`.
      buffer_paths: the pytree path of every buffer in `params`.
      tied_paths: `{alias path: path in params}` for each tensor tied under more than one name.
      frozen_paths: the path of every parameter that had `requires_grad=False` (see `partition`).
    """

    def __init__(
        self,
        module: nn.Module,
        params: dict[str, Any],
        buffer_names: frozenset[str],
        aliases: dict[str, str],
        frozen: frozenset[str] = frozenset(),
    ) -> None:
        self.module = module
        self.frozen_paths: tuple[Path, ...] = tuple(tuple(name.split(".")) for name in sorted(frozen))
        leaves, self._structure = tree.flatten(params)
        self._names = [".".join(path) for path in tree.paths(params)]
        self._shapes = [t.shape for t in leaves]
        self._is_buffer = [name in buffer_names for name in self._names]
        self._buffer_index = [i for i, is_buffer in enumerate(self._is_buffer) if is_buffer]
        # Ties are resolved here, once, and passed to functional_call with tie_weights=False: its own
        # tie_weights=True walks every named parameter and buffer of the module on each call.
        index = {name: i for i, name in enumerate(self._names)}
        self._aliases = [(alias, index[name]) for alias, name in aliases.items()]
        self.param_paths: tuple[Path, ...] = tuple(
            tuple(name.split(".")) for name, b in zip(self._names, self._is_buffer, strict=True) if not b
        )
        self.buffer_paths: tuple[Path, ...] = tuple(
            tuple(name.split(".")) for name, b in zip(self._names, self._is_buffer, strict=True) if b
        )
        self.tied_paths: dict[Path, Path] = {
            tuple(alias.split(".")): tuple(name.split(".")) for alias, name in aliases.items()
        }

    def __call__(self, params: Any, /, *args: Any, **kwargs: Any) -> Any:
        """Run the module's forward on `params`; buffer updates the forward makes are dropped."""
        ordered, _, _, _ = self._ordered_leaves(params)
        named = self._named(ordered)
        with _module_state_kept(self.module):
            return functional_call(self.module, named, args, kwargs, tie_weights=False)

    def partition(self, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """`(trainable, frozen)`: `params` split into two nested dicts, the parameters that had
        `requires_grad=False` (`frozen_paths`) in the second, everything else (buffers too) in the first, as
        equinox's `partition`. Differentiate and update `trainable` only; `combine` joins them for `apply`."""
        frozen_names = {".".join(path) for path in self.frozen_paths}
        trainable: dict[str, Any] = {}
        frozen: dict[str, Any] = {}
        for path, leaf in zip(tree.paths(params), tree.leaves(params)):
            name = ".".join(map(str, path))
            _insert(frozen if name in frozen_names else trainable, name, leaf)
        return trainable, frozen

    @staticmethod
    def combine(*parts: dict[str, Any]) -> dict[str, Any]:
        """The nested dicts of `partition` (or any disjoint nested dicts) merged into one params tree."""
        out: dict[str, Any] = {}
        for part in parts:
            for path, leaf in zip(tree.paths(part), tree.leaves(part)):
                _insert(out, ".".join(map(str, path)), leaf)
        return out

    def with_updates(self, params: Any, /, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Run the forward and also return its buffer updates: `(output, new_params)`.

        `new_params` has the structure of `params`. Buffers the forward changed (in place, like
        BatchNorm's `running_mean`, `running_var` and `num_batches_tracked`, or by reassigning them)
        hold their new values and the other buffers fresh copies of theirs (in-place updates cannot be
        detected reliably: BatchNorm's do not bump the version counter); parameters are the very tensors
        given in `params`. Carry `new_params` into the next step to keep the statistics, as flax does
        with `mutable=["batch_stats"]`.
        """
        ordered, leaves, order, structure = self._ordered_leaves(params)
        named = self._named(ordered)
        # functional_call writes the module's tensors back into `named` when it restores the module, so
        # after the call it holds each buffer's final value: the updated copy, or what forward assigned.
        with _module_state_kept(self.module):
            output = functional_call(self.module, named, args, kwargs, tie_weights=False)
        for alias, i in self._aliases:
            if named[alias] is not named[self._names[i]]:
                # eager torch would untie the two names; params holds one tensor for both
                raise ValueError(
                    f"params{_keystr(alias)}: the forward reassigned it, but it is tied to "
                    f"params{_keystr(self._names[i])} (one tensor in params): with_updates cannot return two "
                    "values for it. Register separate tensors under the two names in the module."
                )
        new_leaves = list(leaves)
        for i in self._buffer_index:
            new_leaves[i if order is None else order[i]] = named[self._names[i]]
        return output, tree.unflatten(structure, new_leaves)

    def _ordered_leaves(self, params: Any) -> tuple[list[Any], list[Any], list[int] | None, tree.TreeSpec]:
        """`params`' leaves in this Apply's order and in its own, the map between them, and its structure.

        Raises ValueError naming the path when `params` does not fit the module.
        """
        leaves, structure = tree.flatten(params)
        if structure == self._structure:
            if [getattr(t, "shape", None) for t in leaves] != self._shapes:
                self._check(dict(zip(self._names, leaves, strict=True)))
            return leaves, leaves, None, structure
        # Another container type with the same keys (an OrderedDict, a registered node) is fine.
        position = {".".join(map(str, path)): i for i, path in enumerate(tree.paths(params))}
        self._check({name: leaves[i] for name, i in position.items()})
        order = [position[name] for name in self._names]
        return [leaves[i] for i in order], leaves, order, structure

    def _named(self, leaves: list[Any]) -> dict[str, torch.Tensor]:
        """The `{dotted name: tensor}` map for functional_call, with buffers copied and ties restored."""
        named = dict(zip(self._names, leaves, strict=True))
        for i in self._buffer_index:
            # A copy, so the forward's in-place buffer updates never reach the caller's tensors; detached, because
            # a buffer is not a parameter: differentiating a tree that holds buffers gives them a zero gradient
            # (BatchNorm's kernel refuses running statistics that require grad).
            named[self._names[i]] = leaves[i].detach().clone()
        for alias, i in self._aliases:
            named[alias] = named[self._names[i]]
        return named

    def _check(self, given: dict[str, Any]) -> None:
        """Raise a ValueError naming the first path where `given` does not fit the module."""
        expected = dict(zip(self._names, self._shapes, strict=True))
        for name, shape in expected.items():
            if name not in given:
                raise ValueError(
                    f"params{_keystr(name)}: missing (the module has a tensor of shape {tuple(shape)} "
                    "there); pass the tree functionalize returned, or one with the same keys"
                )
            leaf = given[name]
            if not isinstance(leaf, torch.Tensor):
                raise ValueError(
                    f"params{_keystr(name)}: expected a tensor of shape {tuple(shape)}, got {type(leaf).__name__}"
                )
            if leaf.shape != shape:
                raise ValueError(f"params{_keystr(name)}: expected shape {tuple(shape)}, got {tuple(leaf.shape)}")
        for name in given:
            if name not in expected:
                aliases = {alias: self._names[i] for alias, i in self._aliases}
                hint = (
                    f"it is tied to params{_keystr(aliases[name])}, which alone holds it"
                    if name in aliases
                    else "the module has no parameter or buffer there"
                )
                raise ValueError(f"params{_keystr(name)}: unexpected key; {hint}")

    def __repr__(self) -> str:
        ties = "".join(f", {'.'.join(alias)} tied to {'.'.join(path)}" for alias, path in self.tied_paths.items())
        return (
            f"Apply({type(self.module).__name__}: {len(self.param_paths)} params, "
            f"{len(self.buffer_paths)} buffers{ties})"
        )


@contextlib.contextmanager
def _module_state_kept(module: nn.Module) -> Iterator[None]:
    """The module's own attributes as they were before a forward: `apply` is pure. A forward that assigns
    `self.last = y`, fills a buffer registered as None, or rebinds a cached list of tensors (LSTM's
    `_flat_weights`) left them on the module, under `pf.jit` as the trace's fake tensors. (functional_call puts
    back only the names it swapped.)

    A new attribute holding a bool stays: it records a one-time setup whose other effects are not undone here
    (Hugging Face installs its output-capturing forward hooks once and sets `_output_capturing_hooks_installed`;
    dropping the flag made every later call install the hooks again, and `hidden_states` came back duplicated)."""
    saved = [(m, dict(m.__dict__), dict(m._buffers)) for m in module.modules()]
    try:
        yield
    finally:
        for m, attributes, buffers in saved:
            for key in [k for k in m.__dict__ if k not in attributes and not _is_setup_flag(m.__dict__[k])]:
                del m.__dict__[key]
            for key, value in attributes.items():
                if m.__dict__.get(key) is not value:
                    m.__dict__[key] = value
            if m._buffers != buffers or any(m._buffers[k] is not v for k, v in buffers.items()):
                m._buffers.clear()
                m._buffers.update(buffers)


def _is_setup_flag(value: Any) -> bool:
    return isinstance(value, bool)  # (a counter, `self.calls = 1`, is state the forward should not leave behind)


def _insert(nest: dict[str, Any], name: str, value: torch.Tensor) -> None:
    """Put `value` at dotted `name` in the nested dict `nest`."""
    *parents, last = name.split(".")
    for key in parents:
        nest = nest.setdefault(key, {})
    nest[last] = value


def _keystr(name: str) -> str:
    """`"blocks.0.weight"` as the user indexes it: `['blocks']['0']['weight']`."""
    return tree.keystr(tuple(name.split(".")))
