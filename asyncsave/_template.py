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

The whole tree is checked before anything changes in place; then objects with
their own ``load_state_dict()`` that asyncsave cannot check (dataloaders,
schedulers, RNG states) are restored first, since they may still refuse, then
modules and optimizers, then tensors. Sources: pytorch/pytorch#148252 and
pytorch/pytorch#137327 (https://github.com/pytorch/pytorch/issues/148252,
https://github.com/pytorch/pytorch/issues/137327).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Mapping, Sequence
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
from ._types import Tagged

__all__ = ["apply_template", "warned"]

_SHOWN = 20  # keys named in a message; the error's attributes hold all of them
# Restored first: what asyncsave cannot check (and may refuse); then checked objects.
_UNCHECKED, _OBJECT, _TENSOR = 0, 1, 2


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
        fit.defer(_UNCHECKED, where, template, lambda: template.load_state_dict(value))
        return template
    if isinstance(template, torch.Tensor):
        if _tensor_fits(fit, value, template, where):
            fit.defer(_TENSOR, where, template, lambda: _copy(template, value))
            return template
        return value
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
    if not where and not any(
        isinstance(v, torch.Tensor) or _is_array(v) for v in template.values()
    ):
        return value  # the top level names items to restore: the others come back as saved
    for k in value:
        if k not in template:
            fit.unexpected.extend(_tensor_keys(value[k], (*where, k)))
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
    strict = fit.strict
    fit.defer(_OBJECT, where, module, lambda: module.load_state_dict(value, strict=strict))
    return module


def _optimizer(fit: _Fit, value: Any, opt: torch.optim.Optimizer, where: tuple[Any, ...]) -> Any:
    """An optimizer: its parameter groups, and each parameter's saved state
    against the template's parameter that state will belong to."""
    if not isinstance(value, Mapping) or not {"state", "param_groups"} <= value.keys():
        fit.mismatch(
            where,
            f"the template holds a {type(opt).__name__}, the checkpoint "
            f"{_describe(value)} without 'state' and 'param_groups'",
        )
        return opt
    groups = value["param_groups"]
    if not isinstance(groups, (list, tuple)):
        groups = []
    sizes = [len(g.get("params", ())) if isinstance(g, Mapping) else -1 for g in groups]
    mine = [len(g["params"]) for g in opt.param_groups]
    if sizes != mine:
        fit.mismatch(
            (*where, "param_groups"),
            f"parameters per group: the checkpoint {sizes}, the optimizer {mine}",
        )
        return opt
    ids = itertools.chain.from_iterable(g.get("params", ()) for g in groups)
    params = itertools.chain.from_iterable(g["params"] for g in opt.param_groups)
    owner = dict(zip(ids, params, strict=True))
    state = value["state"]
    for pid, moments in state.items() if isinstance(state, Mapping) else ():
        if pid not in owner:
            fit.unexpected.extend(_tensor_keys(moments, (*where, "state", pid)))
        elif isinstance(moments, Mapping):
            _moments_fit(fit, opt, moments, owner[pid], (*where, "state", pid))
    saved: Any = value
    fit.defer(_OBJECT, where, opt, lambda: opt.load_state_dict(saved))
    return opt


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
