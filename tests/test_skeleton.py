"""A save matched against the last plan's tree (``_skeleton``) is the
save a fresh checkpointer makes of the same state.

The planner reuses its last plan when the new state's tree walks like the last
one's and every tensor's signature is the same; the new tree shares the last
tree's unchanged nodes and the entries come from a pool. The property: whatever
changed between two saves (a scalar's value or type, a key's type, a container's
type, a tensor's shape, dtype, strides, storage, kind or ``requires_grad``, a
tie made or broken, a module's version metadata), the second save writes the
manifest and the bytes a checkpointer that never saw the first one writes, or
both refuse the state with the same typed error.
"""

from __future__ import annotations

import json
import tempfile
import threading
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncsave
from asyncsave.testing import planning

# Manifest fields that differ between any two saves of one state.
_VOLATILE = ("created_unix_s", "costs", "training_info", "manifest_xxh3_64")


class _Counter:
    """A Stateful object: its ``state_dict()`` is a dict of a tensor and a count."""

    def __init__(self, t: torch.Tensor, n: Any) -> None:
        self.t, self.n = t, n

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.t, self.n = sd["t"], sd["n"]


def _versioned(m: torch.nn.Module, version: Any) -> torch.nn.Module:
    m._version = version
    return m


def _with_metadata() -> OrderedDict[str, Any]:
    """An OrderedDict whose ``_metadata`` holds values whose ``==`` is not
    equality of their encoding: a NumPy scalar (0.0 == -0.0), a Tagged list
    (1 == True), a nested OrderedDict with a ``_metadata`` of its own, a list."""
    inner: OrderedDict[str, Any] = OrderedDict(a=1)
    inner._metadata = {"x": 1}  # type: ignore[attr-defined]
    od: OrderedDict[str, Any] = OrderedDict(w=torch.zeros(2))
    od._metadata = {  # type: ignore[attr-defined]
        "": {
            "version": 1,
            "np": np.float64(0.0),
            "tag": asyncsave.Tagged([1], "k"),
            "inner": inner,
            "list": [1, 2],
        }
    }
    return od


def _optimizer(g: torch.Generator, n: int) -> dict[str, Any]:
    """An optimizer's ``state_dict()`` shape: a dict of per-parameter dicts of
    tensors (one with int keys) and a param group listing ``n`` ints."""
    state: dict[int, dict[Any, torch.Tensor]] = {
        i: {"step": torch.tensor(3.0), "exp_avg": torch.randn(i % 3 + 1, generator=g)}
        for i in range(n)
    }
    state[1] = {0: torch.randn(2, generator=g), 1: torch.randn(2, generator=g)}
    return {"state": state, "param_groups": [{"params": list(range(n)), "lr": 0.1}]}


def _inner(state: dict[str, Any], i: int) -> dict[Any, Any]:
    return state["optim"]["state"][i]  # type: ignore[no-any-return]


def _params(state: dict[str, Any]) -> list[Any]:
    return state["optim"]["param_groups"][0]["params"]  # type: ignore[no-any-return]


def _meta(state: dict[str, Any]) -> dict[str, Any]:
    return state["meta"]._metadata[""]  # type: ignore[no-any-return]


def _base(seed: int, width: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(32, generator=g)
    experts = {f"experts.{i}.w": torch.randn(2, 3, generator=g) for i in range(width)}
    return {
        "experts": experts,  # a dict of tensors only: matched by its key list
        "ints": {i: torch.randn(2, generator=g).to(torch.bfloat16) for i in range(3)},
        "view": shared[4:12],
        "whole": shared,
        "tied_a": (tied := torch.randn(4, generator=g)),
        "tied_b": tied,
        "param": torch.nn.Parameter(torch.randn(3, generator=g)),
        "list": [torch.randn(2, generator=g), 1, "s", None, 2.5],
        "tuple": (True, torch.Size([2, 3]), torch.float16, torch.device("cpu")),
        "tagged": asyncsave.Tagged(torch.arange(3), "rng"),
        "counter": _Counter(torch.randn(2, generator=g), 7),
        "module": torch.nn.BatchNorm1d(2),
        "linear": torch.nn.Linear(2, 2),  # version 1: True == 1, 1.0 == 1
        "floaty": _versioned(torch.nn.Linear(1, 1), 0.0),  # 0.0 == -0.0
        "ordered": OrderedDict(a=torch.zeros(2), b=3),
        "meta": _with_metadata(),
        "optim": _optimizer(g, max(3, width // 4)),
        "lr": np.float32(0.1),
        "step": 10,
    }


def _set(state: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    node = state
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value


# Each change: (name, function of (state, generator)). Every one is a member of
# the kind "the state differs from the last save's"; some keep the plan, most
# do not, a few make the state invalid.
_CHANGES: dict[str, Any] = {
    "new values only": lambda s, g: [t.add_(1) for t in s["experts"].values()],
    "an int's value": lambda s, g: _set(s, ("step",), 11),
    "an int becomes a float": lambda s, g: _set(s, ("step",), 10.0),
    "an int becomes a bool": lambda s, g: _set(s, ("step",), True),
    "a str in a list": lambda s, g: _set(s, ("list", 2), "t"),
    "None becomes 0": lambda s, g: _set(s, ("list", 3), 0),
    "a float's value": lambda s, g: _set(s, ("list", 4), 3.5),
    "a tuple's dtype": lambda s, g: _set(
        s, ("tuple",), (True, torch.Size([2, 3]), torch.float32, torch.device("cpu"))
    ),
    "a tuple's Size": lambda s, g: _set(
        s, ("tuple",), (True, torch.Size([3, 2]), torch.float16, torch.device("cpu"))
    ),
    "a tuple becomes a list": lambda s, g: _set(s, ("tuple",), list(s["tuple"])),
    "a list becomes a tuple": lambda s, g: _set(s, ("list",), tuple(s["list"])),
    "a dict becomes an OrderedDict": lambda s, g: _set(s, ("experts",), OrderedDict(s["experts"])),
    "an OrderedDict becomes a dict": lambda s, g: _set(s, ("ordered",), dict(s["ordered"])),
    "an OrderedDict gains metadata": lambda s, g: setattr(
        s["ordered"], "_metadata", {"": {"version": 2}}
    ),
    "an int key becomes a str key": lambda s, g: _set(
        s, ("ints",), {str(k): v for k, v in s["ints"].items()}
    ),
    "an int key becomes a bool key": lambda s, g: _set(
        s, ("ints",), {bool(k) if k < 2 else k: v for k, v in s["ints"].items()}
    ),
    "an int key becomes a float key": lambda s, g: _set(
        s, ("ints",), {float(k): v for k, v in s["ints"].items()}
    ),
    "a str key is renamed": lambda s, g: s["experts"].__setitem__(
        "other", s["experts"].pop("experts.0.w")
    ),
    "keys in another order": lambda s, g: _set(
        s, ("experts",), dict(reversed(list(s["experts"].items())))
    ),
    "a key added": lambda s, g: s["experts"].__setitem__("extra", torch.zeros(1)),
    "a key removed": lambda s, g: s["experts"].pop("experts.0.w"),
    "a tensor's shape": lambda s, g: _set(
        s, ("experts", "experts.0.w"), torch.randn(3, 2, generator=g)
    ),
    "a tensor's dtype": lambda s, g: _set(
        s, ("experts", "experts.0.w"), s["experts"]["experts.0.w"].double()
    ),
    "a tensor's strides": lambda s, g: _set(
        s, ("experts", "experts.0.w"), torch.randn(3, 2, generator=g).t()
    ),
    "a tensor reallocated": lambda s, g: _set(
        s, ("experts", "experts.0.w"), s["experts"]["experts.0.w"].clone()
    ),
    "a tensor becomes a parameter": lambda s, g: _set(
        s, ("experts", "experts.0.w"), torch.nn.Parameter(s["experts"]["experts.0.w"])
    ),
    "a parameter stops requiring grad": lambda s, g: s["param"].requires_grad_(False),
    "a tensor tied to another": lambda s, g: _set(
        s, ("experts", "experts.1.w"), s["experts"]["experts.0.w"]
    ),
    "a tie broken": lambda s, g: _set(s, ("tied_b",), s["tied_a"].clone()),
    "a view moved in its storage": lambda s, g: _set(s, ("view",), s["whole"][5:13]),
    "a conjugated tensor": lambda s, g: _set(
        s, ("experts", "experts.0.w"), torch.randn(2, 3, dtype=torch.complex64, generator=g).conj()
    ),
    "a tensor becomes an int": lambda s, g: _set(s, ("experts", "experts.0.w"), 3),
    "a tensor becomes a sparse tensor": lambda s, g: _set(
        s, ("experts", "experts.0.w"), torch.eye(2).to_sparse()
    ),
    "a tensor becomes a meta tensor": lambda s, g: _set(
        s, ("experts", "experts.0.w"), torch.empty(2, 3, device="meta")
    ),
    "a Tagged kind": lambda s, g: _set(s, ("tagged",), asyncsave.Tagged(torch.arange(3), "other")),
    "a Stateful's count": lambda s, g: setattr(s["counter"], "n", 8),
    "a Stateful's tensor reshaped": lambda s, g: setattr(
        s["counter"], "t", torch.randn(3, generator=g)
    ),
    "a module's buffer replaced": lambda s, g: setattr(s["module"], "running_mean", torch.ones(2)),
    "a module's version": lambda s, g: setattr(s["module"], "_version", 99),
    "a module's version becomes a bool": lambda s, g: setattr(s["linear"], "_version", True),
    "a module's version becomes a float": lambda s, g: setattr(s["linear"], "_version", 1.0),
    "a float version's sign": lambda s, g: setattr(s["floaty"], "_version", -0.0),
    "a float scalar becomes -0.0": lambda s, g: _set(s, ("list", 4), -0.0),
    "a module gains a submodule": lambda s, g: s["linear"].add_module("extra", torch.nn.Identity()),
    "a Stateful replaced by a dict": lambda s, g: _set(
        s, ("counter",), {"t": torch.zeros(2), "n": 7}
    ),
    "an unsupported leaf": lambda s, g: _set(s, ("list", 1), object()),
    "metadata's NumPy 0.0 becomes -0.0": lambda s, g: _meta(s).__setitem__("np", np.float64(-0.0)),
    "metadata's NumPy float64 becomes a float": lambda s, g: _meta(s).__setitem__("np", 0.0),
    "metadata's Tagged 1 becomes True": lambda s, g: _meta(s).__setitem__(
        "tag", asyncsave.Tagged([True], "k")
    ),
    "metadata's nested OrderedDict's own metadata": lambda s, g: setattr(
        _meta(s)["inner"], "_metadata", {"x": 2}
    ),
    "metadata's list appended in place": lambda s, g: _meta(s)["list"].append(3),
    "metadata's int becomes a bool": lambda s, g: _meta(s).__setitem__("version", True),
    "a NumPy scalar's value": lambda s, g: _set(s, ("lr",), np.float32(0.2)),
    "a NumPy scalar's dtype": lambda s, g: _set(s, ("lr",), np.float64(0.1)),
    "a NumPy scalar becomes a float": lambda s, g: _set(s, ("lr",), 0.1),
    "a float becomes a NumPy scalar": lambda s, g: _set(s, ("list", 4), np.float64(2.5)),
    "an optimizer's inner key renamed": lambda s, g: _inner(s, 0).__setitem__(
        "exp_avg_sq", _inner(s, 0).pop("exp_avg")
    ),
    "an optimizer's inner int key becomes a bool key": lambda s, g: s["optim"]["state"].__setitem__(
        1, {False: _inner(s, 1)[0], True: _inner(s, 1)[1]}
    ),
    "an optimizer's inner int key becomes a float key": lambda s, g: s["optim"][
        "state"
    ].__setitem__(1, {0.0: _inner(s, 1)[0], 1: _inner(s, 1)[1]}),
    "an optimizer's inner dict becomes an OrderedDict": lambda s, g: s["optim"][
        "state"
    ].__setitem__(2, OrderedDict(_inner(s, 2))),
    "an optimizer's step becomes an int": lambda s, g: _inner(s, 0).__setitem__("step", 4),
    "an optimizer's inner dict gains a key": lambda s, g: _inner(s, 2).__setitem__(
        "max_exp_avg_sq", torch.zeros(1)
    ),
    "an optimizer's inner dicts swapped": lambda s, g: s["optim"].__setitem__(
        "state", {**s["optim"]["state"], 0: _inner(s, 2), 2: _inner(s, 0)}
    ),
    "an optimizer's param id becomes a str key": lambda s, g: s["optim"].__setitem__(
        "state", {("0" if k == 0 else k): v for k, v in s["optim"]["state"].items()}
    ),
    "an optimizer's param id renumbered": lambda s, g: s["optim"].__setitem__(
        "state", {(k if k != 2 else 50): v for k, v in s["optim"]["state"].items()}
    ),
    "an optimizer's param ids reordered": lambda s, g: s["optim"].__setitem__(
        "state", dict(reversed(list(s["optim"]["state"].items())))
    ),
    "a param group's id changed": lambda s, g: _params(s).__setitem__(0, 99),
    "a param group's id becomes a bool": lambda s, g: _params(s).__setitem__(1, True),
    "a param group's id becomes a float": lambda s, g: _params(s).__setitem__(1, 1.0),
    "a param group's ids grow": lambda s, g: _params(s).append(7),
    "a param group's ids become a tuple": lambda s, g: s["optim"]["param_groups"][0].__setitem__(
        "params", tuple(_params(s))
    ),
}


def _manifest(path: Path) -> dict[str, Any]:
    doc = json.loads((path / "manifest.json").read_bytes())
    for k in _VOLATILE:
        doc.pop(k, None)
    return doc


def _save(ckpt: asyncsave.SyncCheckpointer, step: int, state: Any) -> BaseException | None:
    try:
        ckpt.save(step, state).result()
    except (asyncsave.CheckpointError, TypeError, ValueError) as exc:
        return exc
    return None


def _same_save(root: Path, first: dict[str, Any], second_of: Any, before: int = 1) -> None:
    """Save ``first`` ``before`` times (a second save of it is matched, which
    keeps what matching needs from it), then the changed state, through one
    checkpointer, and the changed state alone through another; the two last
    saves must agree."""
    last = before + 1
    with asyncsave.SyncCheckpointer(root / "a") as a:
        for step in range(1, last):
            assert _save(a, step, first) is None
        second = second_of()
        err_a = _save(a, last, second)
    with asyncsave.SyncCheckpointer(root / "b") as b:
        err_b = _save(b, last, second)
    assert type(err_a) is type(err_b), (err_a, err_b)
    if err_a is not None:
        assert str(err_a) == str(err_b)
        return
    mine, fresh = root / "a" / f"step_{last}", root / "b" / f"step_{last}"
    assert _manifest(mine) == _manifest(fresh)
    for name in fresh.iterdir():
        if name.name != "manifest.json":
            assert (mine / name.name).read_bytes() == name.read_bytes(), name.name


@pytest.mark.parametrize("change", list(_CHANGES))
@pytest.mark.parametrize("width", [4, 200])  # inline on the loop / in a worker
@pytest.mark.parametrize("before", [1, 2])  # saves of the state before the change
def test_a_matched_save_writes_what_a_fresh_checkpointer_writes(
    tmp_path: Path, change: str, width: int, before: int
) -> None:
    state = _base(0, width)
    g = torch.Generator().manual_seed(1)

    def changed() -> dict[str, Any]:
        _CHANGES[change](state, g)
        return state

    _same_save(tmp_path, state, changed, before)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    changes=st.lists(st.sampled_from(sorted(_CHANGES)), min_size=0, max_size=4),
    width=st.sampled_from([3, 150]),
    seed=st.integers(0, 3),
    before=st.integers(1, 2),
)
def test_any_changes_between_saves_write_what_a_fresh_checkpointer_writes(
    changes: list[str], width: int, seed: int, before: int
) -> None:
    state = _base(seed, width)
    g = torch.Generator().manual_seed(seed + 1)

    def changed() -> dict[str, Any]:
        for c in changes:
            try:
                _CHANGES[c](state, g)
            except (KeyError, IndexError, TypeError, AttributeError, RuntimeError):
                pass  # an earlier change removed what this one changes
        return state

    with tempfile.TemporaryDirectory() as d:
        _same_save(Path(d), state, changed, before)


def test_an_unchanged_structure_is_matched_without_a_flatten(tmp_path: Path) -> None:
    """The second and third saves of one structure are matched (one walk each,
    no grouping), whatever their values; the checkpoints hold each save's values."""
    state = _base(0, 300)
    seen: list[str] = []
    with asyncsave.SyncCheckpointer(tmp_path) as ckpt, planning(seen.append):
        for step in (1, 2, 3):
            for t in state["experts"].values():
                t.fill_(step)
            state["step"] = step
            ckpt.save(step, state).result()
    assert seen == ["flatten", "group", "flatten", "flatten"]
    for step in (1, 2, 3):
        out = asyncsave.load(tmp_path / f"step_{step}", allow_pickle=False)
        assert out["step"] == step
        assert all(bool((t == step).all()) for t in out["experts"].values())


def test_a_model_and_adamw_passed_as_objects_are_matched_in_one_walk(tmp_path: Path) -> None:
    """A model and its AdamW, passed as objects, trained between saves: from
    the second save on each save is one walk (the optimizer's per-parameter
    dicts and its param group's ids matched whole), and writes what a fresh
    checkpointer writes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(40)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": opt, "step": 0}
    seen: list[str] = []
    with asyncsave.SyncCheckpointer(tmp_path / "a") as ckpt, planning(seen.append):
        for step in (1, 2, 3, 4):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            state["step"] = step
            ckpt.save(step, state).result()
    # The first save plans (a flatten, then grouping); each later one matches.
    assert seen == ["flatten", "group", "flatten", "flatten", "flatten"]
    with asyncsave.SyncCheckpointer(tmp_path / "b") as fresh:
        fresh.save(4, state).result()
    assert _manifest(tmp_path / "a" / "step_4") == _manifest(tmp_path / "b" / "step_4")


# Changes of the tree alone (every tensor's signature stays the last plan's),
# with the walks of the save that makes them: a scalar leaf's new value or type
# is matched (1); a container's type or a module's metadata fails the match and
# the flatten follows (2).
_TREE_ONLY = {
    "an int becomes a float": 1,
    "a NumPy scalar's dtype": 1,
    "a Stateful's count": 1,
    "a tuple becomes a list": 2,
    "a module's version becomes a float": 2,
    "metadata's NumPy 0.0 becomes -0.0": 2,
    "metadata's nested OrderedDict's own metadata": 2,
    "metadata's list appended in place": 2,
}


@pytest.mark.parametrize("change", list(_TREE_ONLY))
def test_after_a_tree_only_change_later_saves_are_matched_in_one_walk(
    tmp_path: Path, change: str
) -> None:
    """A save whose tree changed but whose tensors did not keeps the plan's
    layout (no "group"), walking once or twice (see ``_TREE_ONLY``); the saves
    after it are matched in one walk each, never walked twice again."""
    state = _base(0, 200)
    g = torch.Generator().manual_seed(1)
    seen: list[str] = []
    with asyncsave.SyncCheckpointer(tmp_path) as ckpt, planning(seen.append):
        for step in (1, 2):
            ckpt.save(step, state).result()
        assert seen == ["flatten", "group", "flatten"]
        seen.clear()
        _CHANGES[change](state, g)
        ckpt.save(3, state).result()
        assert seen == ["flatten"] * _TREE_ONLY[change]  # no "group": layout kept
        seen.clear()
        for step in (4, 5, 6):
            ckpt.save(step, state).result()
        assert seen == ["flatten"] * 3
    fresh = tmp_path / "fresh"
    with asyncsave.SyncCheckpointer(fresh) as ckpt:
        ckpt.save(6, state).result()
    assert _manifest(tmp_path / "step_6") == _manifest(fresh / "step_6")


@pytest.mark.parametrize(
    "leaf",
    [
        pytest.param(lambda: np.zeros(3, dtype=np.float32), id="numpy-array"),
        pytest.param(
            lambda: __import__("tensordict").TensorDict({"a": torch.zeros(2)}, batch_size=[]),
            id="tensordict",
        ),
    ],
)
def test_a_structure_the_skeleton_cannot_match_is_walked_once_per_save(
    tmp_path: Path, leaf: Any
) -> None:
    """A state holding a leaf kind the skeleton never matches (a NumPy array,
    a TensorDict) is flattened once per save, with no match tried first."""
    state = {**{f"w{i}": torch.zeros(4) for i in range(200)}, "x": leaf()}
    seen: list[str] = []
    with asyncsave.SyncCheckpointer(tmp_path) as ckpt, planning(seen.append):
        for step in (1, 2, 3):
            ckpt.save(step, state).result()
    assert seen == ["flatten", "group", "flatten", "flatten"]


class _Tally:
    """A Stateful object that counts its ``state_dict()`` calls."""

    def __init__(self) -> None:
        self.t = torch.zeros(3)
        self.calls = 0

    def state_dict(self) -> dict[str, Any]:
        self.calls += 1
        return {"t": self.t}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.t = sd["t"]


@pytest.mark.parametrize("width", [4, 200])
def test_a_stateful_object_reached_twice_is_called_once_per_occurrence(
    tmp_path: Path, width: int
) -> None:
    """One object under two keys: its ``state_dict()`` runs twice per save,
    as a flatten alone would call it, whether the save is matched or the match
    fails and the flatten reuses what the match obtained."""
    obj = _Tally()
    state = {"x": obj, "y": obj, "w": {f"e{i}": torch.zeros(4) for i in range(width)}}
    with asyncsave.SyncCheckpointer(tmp_path) as ckpt:
        counts = []
        for step, change in enumerate([None, None, "shape", None, "count"], start=1):
            if change == "shape":
                obj.t = torch.zeros(5)  # the match fails at the signature check
            elif change == "count":
                state["w"]["extra"] = torch.zeros(1)  # fails in the walk
            obj.calls = 0
            ckpt.save(step, state).result()
            counts.append(obj.calls)
    assert counts == [2] * 5
    out = asyncsave.load(tmp_path / "step_5", allow_pickle=True)
    assert out["x"]["t"].shape == (5,)


class _Grower:
    """A Stateful object whose ``state_dict()`` adds an item to the container
    it is walked in, at its ``at``-th call (the callers' code changing the
    state while it is walked)."""

    def __init__(self, parent: Any, at: int) -> None:
        self.parent, self.at, self.calls = parent, at, 0

    def state_dict(self) -> dict[str, Any]:
        self.calls += 1
        if self.calls == self.at:
            if isinstance(self.parent, dict):
                self.parent["extra"] = 1
            else:
                self.parent.append(1)
        return {"n": 1}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


@pytest.mark.parametrize("container", ["dict", "list"])
@pytest.mark.parametrize("width", [4, 200])
def test_a_state_changed_while_walked_saves_or_fails_as_a_fresh_save(
    tmp_path: Path, container: str, width: int
) -> None:
    """A ``state_dict()`` that grows the container being walked, during the
    save that is matched: the save writes what a fresh checkpointer writes of
    the same state at the same call, or raises what it raises (a dict changed
    during iteration; a grown list is walked as it then is). The match does not
    hide the error behind a flatten of what the walk left behind."""

    def make(calls: int) -> dict[str, Any]:
        root: dict[str, Any] = {"w": {f"e{i}": torch.zeros(2) for i in range(width)}}
        parent: Any = root if container == "dict" else [0]
        grower = _Grower(parent, at=2)
        grower.calls = calls
        if container == "dict":
            root["x"] = grower
        else:
            parent.append(grower)
            root["x"] = parent
        root["z"] = 0
        return root

    def outcome(ckpt: asyncsave.SyncCheckpointer, root: Path, step: int, state: Any) -> Any:
        try:
            ckpt.save(step, state).result()
        except Exception as exc:  # compared below
            return (type(exc), str(exc))
        return _manifest(root / f"step_{step}")

    a_state = make(0)
    with asyncsave.SyncCheckpointer(tmp_path / "a") as a:
        assert isinstance(outcome(a, tmp_path / "a", 1, a_state), dict)
        mine = outcome(a, tmp_path / "a", 2, a_state)  # matched, grown at the 2nd call
    with asyncsave.SyncCheckpointer(tmp_path / "b") as b:
        fresh = outcome(b, tmp_path / "b", 2, make(1))  # grown at its first call here
    assert mine == fresh


class _Witness:
    """A Stateful object that records the thread of each ``state_dict()``."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def state_dict(self) -> dict[str, Any]:
        self.threads.append(threading.current_thread().name)
        return {"v": 1}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


@pytest.mark.anyio
async def test_a_stateful_in_metadata_is_called_on_the_loop_once_per_save(
    tmp_path: Path,
) -> None:
    """A ``Stateful`` object inside an ``OrderedDict``'s ``_metadata``: its
    ``state_dict()`` runs on the event loop's thread once per save, whether the
    save is the first, matched, or a failed match followed by a flatten."""
    witness = _Witness()
    od: OrderedDict[str, Any] = OrderedDict(w=torch.zeros(2))
    od._metadata = {"s": witness}  # type: ignore[attr-defined]
    state = {"od": od, "many": {f"e{i}": torch.zeros(2) for i in range(200)}}
    loop_thread = threading.current_thread().name
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2, 3):
            witness.threads.clear()
            if step == 3:
                state["many"]["e0"] = torch.zeros(3)  # the match fails
            await (await ckpt.save(step, state))
            assert witness.threads == [loop_thread], step


def test_pooled_entries_keep_no_tensor_of_a_finished_save(tmp_path: Path) -> None:
    """Entries lent by the planner's pool are handed back without the save's
    tensors: a tensor the caller drops after a save is freed, not kept alive
    by the pool for the next save."""
    state = {f"w{i}": torch.randn(4) for i in range(300)}
    with asyncsave.SyncCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, state).result()
        for step in (2, 3):
            state["w0"] = torch.randn(4)  # reallocated: replanned, then matched
            ckpt.save(step, state).result()
        probe = weakref.ref(state["w5"])
        state["w5"] = state["w5"].clone()
        ckpt.save(4, state).result()
        old = state.pop("w5")
        del old
        ckpt.save(5, {**state, "w5": torch.randn(4)}).result()
        assert probe() is None


@pytest.mark.anyio
@pytest.mark.parametrize("overlap_writes", [None, True])
async def test_saves_in_flight_each_keep_their_own_pooled_entries(
    tmp_path: Path, overlap_writes: bool | None
) -> None:
    """Several saves of one structure in flight at once (each staged while the
    earlier ones write) take distinct entries from the pool: every checkpoint
    holds its own step's bytes."""
    state = {f"w{i}": torch.zeros(64) for i in range(300)}
    async with asyncsave.Checkpointer(tmp_path, overlap_writes=overlap_writes) as ckpt:
        handles = []
        for step in range(1, 9):
            for t in state.values():
                t.fill_(step)
            handles.append(await ckpt.save(step, state))
        for h in handles:
            await h
    for step in range(1, 9):
        out = asyncsave.load(tmp_path / f"step_{step}", allow_pickle=False)
        assert all(bool((t == step).all()) for t in out.values()), step
