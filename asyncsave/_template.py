"""Loading into a template: one rule for every form a template takes.

A template mirrors the saved tree; where it holds a module, an optimizer, a
tensor, a ``state_dict()``, a nested dict or list, or any ``Stateful`` object, the
saved state is matched against it, the way ``torch.nn.Module.load_state_dict``
with ``strict=True`` matches one module, applied to the whole tree:

1. Every key of a template dict (and of a module's ``state_dict()``) must be in
   the checkpoint: *missing* otherwise.
2. Every saved tensor inside an item the template names must have a place in
   the template: *unexpected* otherwise (a saved key the template lacks, holding
   tensors; any key a module lacks). The template's top level names the items to
   restore (``{"model": model, "optim": opt}``): a top-level item it leaves out
   comes back in the result as saved (``required=`` demands one), unless the top
   level is itself a state dict (it holds tensors directly).
3. A tensor the template holds must have the saved tensor's shape and dtype; an
   optimizer's per-parameter state (Adam's ``exp_avg``, SGD's
   ``momentum_buffer``) must have its parameter's shape: *mismatched* otherwise.
4. Plain values (numbers, strings, bytes, lists and tuples holding no tensor) take
   the saved value, whatever the template holds there: a list that grew or shrank
   since the template was built comes back as saved. ``None`` takes anything.

Missing and unexpected items are a :class:`~asyncsave.TemplateMismatchError`
(:class:`~asyncsave.MissingItemError` when every problem is a missing item) unless
``strict=False``, which loads what matches and reports the rest in one
:class:`~asyncsave.CheckpointWarning`. A mismatched tensor is always an error:
nothing could load it.

An object with its own ``state_dict()`` / ``load_state_dict()`` (DCP's
``Stateful``: an "AppState" wrapper holding a model and an optimizer, as in
https://pytorch.org/tutorials/recipes/distributed_checkpoint_recipe.html) is
checked by the same rule: what its ``state_dict()`` returns now is the template of
what its ``load_state_dict()`` will be given. An optimizer inside it is checked
against its parameters when its ``state_dict()`` reaches the wrapper's unchanged
and the optimizer itself is reachable from the wrapper's attributes (directly, or
through dicts, lists and nested wrappers); any other optimizer state is checked
against the optimizer's current state. With ``strict=False`` the object is given
the saved state with its missing items taken from its current state and its
unexpected ones left out, so that a strict loader of its own loads what matches.
An object whose ``state_dict()`` holds no tensor cannot be checked, and
:class:`~asyncsave.RNGState` checks what it is given itself: their own loader
decides.

The whole tree is checked before anything changes in place; then objects with
their own ``load_state_dict()`` that asyncsave cannot check (dataloaders,
schedulers, RNG states) are restored first, since they may still refuse, then
modules, optimizers and checked objects, then tensors. Sources: pytorch/pytorch#148252 and
pytorch/pytorch#137327 (https://github.com/pytorch/pytorch/issues/148252,
https://github.com/pytorch/pytorch/issues/137327).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ._errors import (
    CheckpointWarning,
    InvalidStateError,
    KindMismatchError,
    MissingItemError,
    TemplateMismatchError,
)
from ._plan import is_stateful, key_str
from ._rng import RNGState
from ._types import Tagged

__all__ = ["apply_template", "warned"]

_SHOWN = 20  # keys named in a message; the error's attributes hold all of them
# Restored first: what asyncsave cannot check (and may refuse); then checked objects.
_UNCHECKED, _OBJECT, _TENSOR = 0, 1, 2
# asyncsave's own objects whose loader checks what it is given: RNGState restores
# the CUDA devices both runs have (their number may differ), so its state is no
# template of what it loads.
_OWN_LOADER = (RNGState,)


@dataclass
class _Fit:
    """What matching a template against a loaded tree found, and the in-place
    changes to make once every check passed."""

    path: Path
    strict: bool
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    actions: list[tuple[int, str, str, Callable[[], None]]] = field(default_factory=list)
    # False inside a Stateful object's state: check only, and build what its own
    # load_state_dict() is given (it restores in place, not asyncsave).
    in_place: bool = True
    # id() of an optimizer state dict met inside a Stateful object's state -> the
    # optimizer whose state_dict() made it.
    made_by: dict[int, tuple[torch.optim.Optimizer, Any]] = field(default_factory=dict)

    def mismatch(self, where: tuple[Any, ...], why: str) -> None:
        self.mismatched.append(key_str(where))
        self.reasons.append(f"{key_str(where)!r}: {why}")

    def defer(
        self, order: int, where: tuple[Any, ...], owner: Any, action: Callable[[], None]
    ) -> None:
        """Run ``action`` (restoring ``owner`` in place) once the tree fits."""
        self.actions.append((order, key_str(where), type(owner).__name__, action))


def apply_template(
    value: Any, template: Any, path: Path, *, strict: bool = True
) -> tuple[Any, CheckpointWarning | None]:
    """Match ``template`` against the loaded tree ``value`` (see the module
    docstring), then restore the template's objects and tensors in place.

    :returns: the tree (the template's objects in their places) and, with
        ``strict=False``, the warning naming what did not match (for the caller to
        issue on its own thread), else ``None``.
    :raises TemplateMismatchError: a tensor of another shape or dtype, or (strict)
        unexpected items; nothing was changed in place.
    :raises MissingItemError: (strict) only missing items; nothing was changed.
    :raises KindMismatchError: a :class:`Tagged` kind differs from the template's.
    :raises InvalidStateError: an object's own ``load_state_dict()`` refused.
    """
    if template is None:
        return value, None
    fit = _Fit(path, strict)
    out = _match(fit, value, template, ())
    _raise_if_unfit(fit)
    for _, where, owner, action in sorted(fit.actions, key=lambda a: a[0]):
        _restore(action, where, owner, path)
    note = None
    if fit.missing or fit.unexpected:
        note = CheckpointWarning(
            f"loaded {path} into the template with strict=False; not loaded: "
            + _listing(fit.missing, fit.unexpected)
        )
    return out, note


def _restore(action: Callable[[], None], where: str, owner: str, path: Path) -> None:
    try:
        action()
    except Exception as exc:  # the object's own loader: translated at this boundary
        raise InvalidStateError(
            f"{where!r}: {owner}.load_state_dict() refused what {path} holds there: {exc}",
            path=path,
            key=where,
        ) from exc


def _listing(missing: list[str], unexpected: list[str], reasons: Sequence[str] = ()) -> str:
    parts = []
    for what, keys in (("missing", missing), ("unexpected", unexpected)):
        if keys:
            shown = ", ".join(map(repr, keys[:_SHOWN]))
            more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
            parts.append(f"{len(keys)} {what} item(s) {shown}{more}")
    if reasons:
        more = f" and {len(reasons) - _SHOWN} more" if len(reasons) > _SHOWN else ""
        parts.append(f"{len(reasons)} mismatched: " + "; ".join(reasons[:_SHOWN]) + more)
    return "; ".join(parts)


def _raise_if_unfit(fit: _Fit) -> None:
    loose = not fit.strict
    if not fit.mismatched and (loose or not (fit.missing or fit.unexpected)):
        return
    missing = [] if loose else fit.missing
    unexpected = [] if loose else fit.unexpected
    what = _listing(missing, unexpected, fit.reasons)
    first = (fit.mismatched or missing or unexpected)[0]
    if not fit.mismatched and not unexpected:
        raise MissingItemError(
            f"checkpoint {fit.path} does not fit the template: {what}; nothing was "
            "loaded. Pass strict=False to load what matches, or a template without them",
            path=fit.path,
            key=first,
        )
    fix = (
        "a tensor of another shape or dtype cannot be loaded in place: load without "
        "a template and convert"
        if fit.mismatched
        else "pass strict=False to load what matches"
    )
    raise TemplateMismatchError(
        f"checkpoint {fit.path} does not fit the template: {what}; nothing was loaded ({fix})",
        path=fit.path,
        key=first,
        missing=missing,
        unexpected=unexpected,
        mismatched=fit.mismatched,
    )


def _match(fit: _Fit, value: Any, template: Any, where: tuple[Any, ...]) -> Any:
    """The result at ``where``; records what does not fit and what to restore."""
    if template is None:
        return value
    if isinstance(template, Tagged):
        return _tagged(fit, value, template, where)
    if isinstance(value, Tagged):
        value = value.value
    if isinstance(template, torch.nn.Module):
        return _module(fit, value, template, where)
    if isinstance(template, torch.optim.Optimizer):
        return _optimizer(fit, value, template, where)
    if is_stateful(template):
        return _stateful(fit, value, template, where)
    if isinstance(template, torch.Tensor):
        return _tensor(fit, value, template, where)
    if not fit.in_place and _is_optimizer_state(template):
        return _optimizer_state(fit, value, template, where)
    if _is_array(template):  # NumPy: checked, returned as saved (not filled in place)
        _tensor_fits(fit, value, template, where)
        return value
    if isinstance(template, dict):
        return _mapping(fit, value, template, where)
    if isinstance(template, (list, tuple)):
        return _sequence(fit, value, template, where)
    if not _is_tensordict(template):
        fit.unexpected.extend(_tensor_keys(value, where))
    return value


def _tagged(fit: _Fit, value: Any, template: Tagged[Any], where: tuple[Any, ...]) -> Any:
    if not isinstance(value, Tagged) or value.kind != template.kind:
        saved = "without a kind tag" if not isinstance(value, Tagged) else f"as kind {value.kind!r}"
        raise KindMismatchError(
            f"{key_str(where)!r} in {fit.path} was saved {saved}; the loader expects "
            f"kind {template.kind!r}",
            path=fit.path,
            key=key_str(where),
        )
    return Tagged(_match(fit, value.value, template.value, where), value.kind)


def _tensor(fit: _Fit, value: Any, template: torch.Tensor, where: tuple[Any, ...]) -> Any:
    if _tensor_fits(fit, value, template, where) and fit.in_place:
        fit.defer(_TENSOR, where, template, lambda: _copy(template, value))
        return template
    return value


def _copy(template: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        template.copy_(value)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor) or _is_array(x):
        return f"{x.dtype} {tuple(x.shape)}"
    return type(x).__name__


def _tensor_fits(fit: _Fit, value: Any, template: Any, where: tuple[Any, ...]) -> bool:
    """A saved tensor (array) of the template tensor's (array's) shape and dtype."""
    same_kind = (
        isinstance(value, torch.Tensor) if isinstance(template, torch.Tensor) else _is_array(value)
    )
    if same_kind and tuple(value.shape) == tuple(template.shape) and value.dtype == template.dtype:
        return True
    fit.mismatch(
        where, f"the template holds {_describe(template)}, the checkpoint {_describe(value)}"
    )
    return False


def _mapping(fit: _Fit, value: Any, template: dict[Any, Any], where: tuple[Any, ...]) -> Any:
    if not isinstance(value, dict):
        if _holds_state(template):
            fit.mismatch(where, f"the template holds a dict, the checkpoint {_describe(value)}")
        return value  # plain: the saved value
    for k, sub in template.items():
        if k in value:
            value[k] = _match(fit, value[k], sub, (*where, k))
        else:
            fit.missing.append(key_str((*where, k)))
            value[k] = sub  # strict=False: the template's own item stays
    if (
        fit.in_place
        and not where
        and not any(isinstance(v, torch.Tensor) or _is_array(v) for v in template.values())
    ):
        return value  # the top level names items to restore: the others come back as saved
    extra = {k: _tensor_keys(value[k], (*where, k)) for k in value if k not in template}
    for k, keys in extra.items():
        fit.unexpected.extend(keys)
        if keys and not fit.in_place:
            del value[k]  # strict=False: an object's own loader is given what matches
    return value


def _sequence(
    fit: _Fit, value: Any, template: list[Any] | tuple[Any, ...], where: tuple[Any, ...]
) -> Any:
    if not isinstance(value, (list, tuple)):
        if _holds_state(template):
            fit.mismatch(
                where,
                f"the template holds a {type(template).__name__}, the checkpoint "
                f"{_describe(value)}",
            )
        return value
    if not _holds_state(template) and not _tensor_keys(value, where):
        return value  # plain items: the saved ones, however many
    items = []
    for i in range(max(len(value), len(template))):
        if i >= len(value):
            fit.missing.append(key_str((*where, i)))
            items.append(template[i])
        elif i >= len(template):
            fit.unexpected.extend(_tensor_keys(value[i], (*where, i)))
            items.append(value[i])
        else:
            items.append(_match(fit, value[i], template[i], (*where, i)))
    return items if isinstance(value, list) else tuple(items)


def _module(fit: _Fit, value: Any, module: torch.nn.Module, where: tuple[Any, ...]) -> Any:
    """A module: its ``state_dict()`` keys, shapes and dtypes against the saved
    ones (every key counts, as for ``load_state_dict(strict=True)``)."""
    if not isinstance(value, Mapping):
        fit.mismatch(where, f"the template holds a module, the checkpoint {_describe(value)}")
        return module
    expected = module.state_dict()
    for k, t in expected.items():
        if k not in value:
            fit.missing.append(key_str((*where, k)))
        elif isinstance(t, torch.Tensor):
            _tensor_fits(fit, value[k], t, (*where, k))
    fit.unexpected.extend(key_str((*where, k)) for k in value if k not in expected)
    if not fit.in_place:
        return _loose(fit, value, expected)
    strict = fit.strict
    fit.defer(_OBJECT, where, module, lambda: module.load_state_dict(value, strict=strict))
    return module


def _loose(fit: _Fit, value: Any, current: Mapping[Any, Any]) -> Any:
    """What a strict loader of an object's own is given with ``strict=False``: the
    saved items that match, and its current ones where the checkpoint has none."""
    if fit.strict or not isinstance(value, dict):
        return value
    for k in [k for k in value if k not in current]:
        del value[k]
    value.update((k, v) for k, v in current.items() if k not in value)
    return value


def _optimizer(fit: _Fit, value: Any, opt: torch.optim.Optimizer, where: tuple[Any, ...]) -> Any:
    """An optimizer: its parameter groups, and each parameter's saved state
    against the template's parameter that state will belong to."""
    _optimizer_fits(fit, value, opt, where)
    if not fit.in_place:
        return value
    saved: Any = value
    fit.defer(_OBJECT, where, opt, lambda: opt.load_state_dict(saved))
    return opt


def _optimizer_fits(
    fit: _Fit, value: Any, opt: torch.optim.Optimizer, where: tuple[Any, ...]
) -> None:
    now = {"param_groups": opt.param_groups}
    if not _groups_fit(fit, value, now, where, type(opt).__name__):
        return
    groups = value["param_groups"]
    ids = itertools.chain.from_iterable(g.get("params", ()) for g in groups)
    params = itertools.chain.from_iterable(g["params"] for g in opt.param_groups)
    owner = dict(zip(ids, params, strict=True))
    state = value["state"]
    for pid, moments in state.items() if isinstance(state, Mapping) else ():
        if pid not in owner:
            fit.unexpected.extend(_tensor_keys(moments, (*where, "state", pid)))
        elif isinstance(moments, Mapping):
            _moments_fit(fit, opt, moments, owner[pid], (*where, "state", pid))


def _groups_fit(
    fit: _Fit, value: Any, current: Mapping[str, Any], where: tuple[Any, ...], what: str
) -> bool:
    """A saved optimizer state dict with as many parameters per group as
    ``current`` (an optimizer's state dict now)."""
    if not _is_optimizer_state(value):
        fit.mismatch(
            where,
            f"the template holds a {what}, the checkpoint {_describe(value)} without "
            "'state' and 'param_groups'",
        )
        return False
    sizes, mine = _group_sizes(value["param_groups"]), _group_sizes(current["param_groups"])
    if sizes != mine:
        fit.mismatch(
            (*where, "param_groups"),
            f"parameters per group: the checkpoint {sizes}, the optimizer {mine}",
        )
        return False
    return True


def _group_sizes(groups: Any) -> list[int]:
    if not isinstance(groups, (list, tuple)):
        return []
    return [len(g.get("params", ())) if isinstance(g, Mapping) else -1 for g in groups]


def _is_optimizer_state(x: Any) -> bool:
    return isinstance(x, Mapping) and {"state", "param_groups"} <= x.keys()


def _optimizer_state(fit: _Fit, value: Any, current: Any, where: tuple[Any, ...]) -> Any:
    """An optimizer's state dict inside a Stateful object's state: checked against
    the optimizer's parameters when its maker is known, else against the state the
    optimizer holds now (a fresh one holds none: only its groups are checked)."""
    maker = fit.made_by.get(id(current))
    if maker is not None and maker[1] is current:
        _optimizer_fits(fit, value, maker[0], where)
        return value
    if not _groups_fit(fit, value, current, where, "optimizer state dict"):
        return value
    saved, now = value["state"], current["state"]
    if not isinstance(saved, Mapping) or not isinstance(now, Mapping):
        return value
    for pid in saved.keys() & now.keys():
        mine, theirs = now[pid], saved[pid]
        if isinstance(mine, Mapping) and isinstance(theirs, Mapping):
            for name in mine.keys() & theirs.keys():
                if isinstance(mine[name], torch.Tensor):
                    _tensor_fits(fit, theirs[name], mine[name], (*where, "state", pid, name))
    return value


def _stateful(fit: _Fit, value: Any, obj: Any, where: tuple[Any, ...]) -> Any:
    """An object with its own ``state_dict()`` / ``load_state_dict()``: its state
    now is the template of what it is given (see the module docstring)."""
    current = None if isinstance(obj, _OWN_LOADER) else _current_state(fit, obj, where)
    if not _holds_state(current):  # nothing to check: the object's own loader decides
        if not fit.in_place:
            return value
        fit.defer(_UNCHECKED, where, obj, lambda: obj.load_state_dict(value))
        return obj
    outer, fit.in_place = fit.in_place, False
    try:
        state = _match(fit, value, current, where)
    finally:
        fit.in_place = outer
    if not outer:
        return state
    fit.defer(_OBJECT, where, obj, lambda: obj.load_state_dict(state))
    return obj


def _current_state(fit: _Fit, obj: Any, where: tuple[Any, ...]) -> Any:
    """``obj.state_dict()`` now, noting which optimizer reachable from ``obj`` made
    each optimizer state dict met on the way."""
    made: list[tuple[torch.optim.Optimizer, Any]] = []

    def note(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
        made.append((opt, sd))

    hooks = [opt.register_state_dict_post_hook(note) for opt in _reachable_optimizers(obj)]
    try:
        current = obj.state_dict()
    except Exception as exc:  # the object's own code: name where it failed
        raise InvalidStateError(
            f"{key_str(where)!r}: {type(obj).__name__}.state_dict() raised {exc!r} while "
            f"checking {fit.path} against it; nothing was loaded",
            path=fit.path,
            key=key_str(where),
        ) from exc
    finally:
        for hook in hooks:
            hook.remove()
    fit.made_by.update((id(sd), (opt, sd)) for opt, sd in made)
    return current


_REACH_DEPTH = 3  # attribute levels searched for optimizers below a Stateful object
_REACH_WIDTH = 64  # items looked at per object, dict or list


def _reachable_optimizers(obj: Any) -> list[torch.optim.Optimizer]:
    """The optimizers among ``obj``'s attributes, directly or through dicts, lists,
    tuples and other Stateful objects (nested wrappers), a few levels down."""
    found: list[torch.optim.Optimizer] = []
    seen: set[int] = set()
    todo: list[tuple[Any, int]] = [(obj, 0)]
    while todo:
        x, depth = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.optim.Optimizer):
            found.append(x)
            continue
        if isinstance(x, dict):
            kids: Iterable[Any] = x.values()
        elif isinstance(x, (list, tuple)):
            kids = x
        elif is_stateful(x) and not isinstance(x, torch.nn.Module):
            kids = vars(x).values() if hasattr(x, "__dict__") else ()
        else:
            continue
        if depth < _REACH_DEPTH:
            todo.extend((k, depth + 1) for k in itertools.islice(kids, _REACH_WIDTH))
    return found


# torch.optim's own optimizers keep state of their parameter's shape, or scalars;
# Adafactor also keeps factored (row and column) statistics. Other optimizers
# (8-bit, LBFGS, Shampoo) keep state of other shapes: their loader decides.
_ELEMENTWISE = tuple(
    getattr(torch.optim, name)
    for name in "SGD Adam AdamW Adamax NAdam RAdam Adagrad Adadelta RMSprop Rprop ASGD "
    "SparseAdam Adafactor".split()
    if hasattr(torch.optim, name)
)


def _moments_fit(
    fit: _Fit,
    opt: torch.optim.Optimizer,
    moments: Mapping[Any, Any],
    param: torch.Tensor,
    where: tuple[Any, ...],
) -> None:
    if not isinstance(opt, _ELEMENTWISE):
        return
    factored = type(opt).__name__ == "Adafactor"
    for name, t in moments.items():
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            continue  # "step" and other scalars
        shape, want = tuple(t.shape), tuple(param.shape)
        ok = shape == want or (
            factored
            and len(shape) == len(want)
            and all(a in (b, 1) for a, b in zip(shape, want, strict=True))
        )
        if not ok:
            fit.mismatch(
                (*where, name),
                f"optimizer state of shape {shape} for a parameter of shape {want} "
                "(parameters reordered or the model changed since the save?)",
            )


def _is_array(x: Any) -> bool:
    return type(x).__module__ == "numpy" and type(x).__name__ == "ndarray"


def _is_tensordict(x: Any) -> bool:
    return any(c.__name__ == "TensorDictBase" for c in type(x).__mro__)


def _holds_state(x: Any) -> bool:
    """A template subtree holding a tensor or an object restored in place."""
    if isinstance(x, torch.Tensor) or _is_array(x) or _is_tensordict(x) or is_stateful(x):
        return True
    if isinstance(x, Tagged):
        return _holds_state(x.value)
    if isinstance(x, dict):
        return any(_holds_state(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_holds_state(v) for v in x)
    return False


def _tensor_keys(x: Any, where: tuple[Any, ...]) -> list[str]:
    """The key paths of the tensors (and arrays) in a loaded subtree."""
    if isinstance(x, torch.Tensor) or _is_array(x) or _is_tensordict(x):
        return [key_str(where)]
    if isinstance(x, Tagged):
        return _tensor_keys(x.value, where)
    if isinstance(x, dict):
        return [k for key, v in x.items() for k in _tensor_keys(v, (*where, key))]
    if isinstance(x, (list, tuple)):
        return [k for i, v in enumerate(x) for k in _tensor_keys(v, (*where, i))]
    return []


def warned(found: tuple[Any, CheckpointWarning | None], stacklevel: int) -> Any:
    """``found``'s result, after issuing its warning (if any) ``stacklevel`` frames
    up: the line that called ``load_latest()``, on its own thread."""
    result, note = found
    if note is not None:
        warnings.warn(note, stacklevel=stacklevel)
    return result
