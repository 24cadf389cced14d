"""One rule for loading into a template, whatever its form (a module, an
optimizer, a ``state_dict()``, a nested tree, a ``Stateful`` object): missing and
unexpected items are a typed error unless ``strict=False``; plain leaves take the
saved value; a tensor of another shape or dtype (optimizer state against its
parameter included) is a typed error naming the key, raised before anything is
changed in place. Sources: pytorch/pytorch#148252 and #137327.

Also: a checksum error of ``load_latest()`` says how to fall back.
"""

from __future__ import annotations

import copy
import itertools
import pickle
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import asyncsave

pytestmark = pytest.mark.anyio


def save(root: Path, state: Any, step: int = 1) -> Path:
    with asyncsave.SyncCheckpointer(root) as ckpt:
        ckpt.save(step, state).result()
    return root / f"step_{step}"


def snapshot(tree: Any) -> list[torch.Tensor]:
    """Copies of every tensor a template holds (module and optimizer state too)."""
    out: list[torch.Tensor] = []
    if isinstance(tree, torch.Tensor):
        out.append(tree.detach().clone())
    elif isinstance(tree, torch.nn.Module):
        out += [t.detach().clone() for t in tree.state_dict().values()]
    elif isinstance(tree, torch.optim.Optimizer):
        for st_ in tree.state.values():
            out += [t.clone() for t in st_.values() if isinstance(t, torch.Tensor)]
    elif isinstance(tree, dict):
        for v in tree.values():
            out += snapshot(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            out += snapshot(v)
    return out


def unchanged(before: list[torch.Tensor], template: Any) -> bool:
    after = snapshot(template)
    return len(before) == len(after) and all(
        a.shape == b.shape and torch.equal(a, b) for a, b in zip(before, after, strict=True)
    )


def trained(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        model(torch.randn(5, 3)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


# -- the same answer for every form -----------------------------------------------


def _two_layers() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))


def _one_layer() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 3))


FORMS = {
    "module": lambda m: m,
    "state_dict": lambda m: m.state_dict(),
    "nested tree": lambda m: {k: v for k, v in m.state_dict().items()},
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_extra_saved_layers_are_refused_before_anything_changes(tmp_path: Path, form: str) -> None:
    """A template with fewer layers than the checkpoint (a state_dict() template
    used to load layer 0 in place and drop the rest silently)."""
    path = save(tmp_path, {"model": _two_layers().state_dict(), "step": 3})
    small = _one_layer()
    template = {"model": FORMS[form](small), "step": 0}
    before = snapshot(template)
    with pytest.raises(asyncsave.TemplateMismatchError) as err:
        asyncsave.load(path, template)
    assert set(err.value.unexpected) == {"model/1.weight", "model/1.bias"}
    assert "model/1.weight" in str(err.value) and "strict=False" in str(err.value)
    assert err.value.missing == () and err.value.mismatched == ()
    assert unchanged(before, template)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_missing_layers_are_refused_before_anything_changes(tmp_path: Path, form: str) -> None:
    path = save(tmp_path, {"model": _one_layer().state_dict()})
    template = {"model": FORMS[form](_two_layers())}
    before = snapshot(template)
    with pytest.raises(asyncsave.MissingItemError) as err:
        asyncsave.load(path, template)
    assert "model/1.weight" in str(err.value) and "model/1.bias" in str(err.value)
    assert err.value.key in ("model/1.weight", "model/1.bias")
    assert unchanged(before, template)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_shape_or_dtype_mismatch_names_the_key_even_when_not_strict(
    tmp_path: Path, form: str
) -> None:
    path = save(tmp_path, {"model": torch.nn.Linear(3, 4).state_dict()})
    for other in (torch.nn.Linear(3, 5), torch.nn.Linear(3, 4).to(torch.float64)):
        template = {"model": FORMS[form](other)}
        before = snapshot(template)
        for strict in (True, False):
            with pytest.raises(asyncsave.TemplateMismatchError) as err:
                asyncsave.load(path, template, strict=strict)
            assert set(err.value.mismatched) == {"model/weight", "model/bias"}
            assert "'model/weight'" in str(err.value)
            assert isinstance(err.value, asyncsave.InvalidStateError)
            assert unchanged(before, template)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_strict_false_loads_what_matches_and_warns_naming_the_rest(
    tmp_path: Path, form: str
) -> None:
    saved = _two_layers()
    path = save(tmp_path, {"model": saved.state_dict()})
    small = _one_layer()
    template = {"model": FORMS[form](small), "extra": torch.zeros(2)}
    with pytest.warns(asyncsave.CheckpointWarning) as record:
        out = asyncsave.load(path, template, strict=False)
    message = str(record[0].message)
    assert "model/1.weight" in message and "'extra'" in message and "missing" in message
    assert record[0].filename == __file__  # names the caller's line
    assert torch.equal(small[0].weight, saved[0].weight)
    assert torch.equal(out["extra"], torch.zeros(2))  # the template's own, untouched


# -- plain leaves take the saved value ----------------------------------------------


@pytest.mark.parametrize(
    "placeholder",
    [[], [1.0, 2.0, 3.0], (), 0, "none yet", {"a": 1}, None],
    ids=["empty list", "longer list", "tuple", "int", "str", "dict", "None"],
)
def test_a_plain_leaf_takes_the_saved_value_whatever_the_template_holds(
    tmp_path: Path, placeholder: Any
) -> None:
    """A list of evals that grew since the template was built (it used to raise
    MissingItemError, while an int in the same place took the saved value)."""
    path = save(tmp_path, {"evals": [0.5, 0.75], "w": torch.arange(3.0)})
    target = torch.zeros(3)
    out = asyncsave.load(path, {"evals": placeholder, "w": target})
    assert out["evals"] == [0.5, 0.75]
    assert out["w"] is target and torch.equal(target, torch.arange(3.0))


def test_an_extra_plain_item_of_the_checkpoint_is_returned_not_refused(tmp_path: Path) -> None:
    path = save(tmp_path, {"trainer": {"step": 7, "epoch": 2}, "w": torch.ones(2)})
    out = asyncsave.load(path, {"trainer": {"step": 0}, "w": torch.zeros(2)})
    assert out["trainer"] == {"step": 7, "epoch": 2}


def test_a_template_names_the_top_level_items_it_restores(tmp_path: Path) -> None:
    """The documented pattern: the template names what to restore in place; the
    checkpoint's other top-level items (a buffer, an RNG state) come back as saved.
    A bare state dict as the whole template is matched strictly."""
    model = _two_layers()
    rng = torch.get_rng_state()
    path = save(tmp_path, {"model": model, "rng": rng, "buffer": {"ids": torch.arange(4)}})
    model2 = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    out = asyncsave.load(path, {"model": model2})
    assert torch.equal(out["rng"], rng) and torch.equal(out["buffer"]["ids"], torch.arange(4))
    assert out["model"] is model2 and torch.equal(model2[1].bias, model[1].bias)
    bare = save(tmp_path / "bare", model.state_dict())
    template = _one_layer().state_dict()
    before = snapshot(template)
    with pytest.raises(asyncsave.TemplateMismatchError) as err:
        asyncsave.load(bare, template)
    assert set(err.value.unexpected) == {"1.weight", "1.bias"}
    assert unchanged(before, template)


def test_saved_tensors_where_the_template_holds_a_plain_value_are_unexpected(
    tmp_path: Path,
) -> None:
    path = save(tmp_path, {"evals": [torch.ones(2), torch.zeros(2)]})
    with pytest.raises(asyncsave.TemplateMismatchError) as err:
        asyncsave.load(path, {"evals": []})
    assert set(err.value.unexpected) == {"evals/0", "evals/1"}
    out = asyncsave.load(path, {"evals": None})  # None takes anything
    assert len(out["evals"]) == 2


# -- optimizers: state against the parameter it will belong to ---------------------


def _swapped(opt_cls: type[torch.optim.Optimizer], **kw: Any) -> tuple[Any, Any]:
    """A model and an optimizer whose group lists weight and bias the other way
    round (parameters collected in another order than at save time)."""
    model = torch.nn.Linear(3, 4)
    return model, opt_cls([model.bias, model.weight], **kw)


OPTIMIZERS = [
    (torch.optim.Adam, {}),
    (torch.optim.AdamW, {"amsgrad": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.RMSprop, {}),
    (torch.optim.Adagrad, {}),
]


@pytest.mark.parametrize(("opt_cls", "kw"), OPTIMIZERS, ids=lambda x: getattr(x, "__name__", ""))
def test_swapped_parameters_in_an_optimizer_group_are_refused_before_anything_changes(
    tmp_path: Path, opt_cls: type[torch.optim.Optimizer], kw: dict[str, Any]
) -> None:
    """They used to load silently; the next optimizer.step() crashed."""
    model = torch.nn.Linear(3, 4)
    opt = opt_cls(model.parameters(), **kw)
    trained(model, opt)
    path = save(tmp_path, {"model": model, "optim": opt})
    model2, opt2 = _swapped(opt_cls, **kw)
    trained(model2, opt2, 1)
    template = {"model": model2, "optim": opt2}
    before = snapshot(template)
    with pytest.raises(asyncsave.TemplateMismatchError) as err:
        asyncsave.load(path, template)
    assert err.value.mismatched and all(
        k.startswith(("optim/state/0/", "optim/state/1/")) for k in err.value.mismatched
    )
    assert "parameter of shape" in str(err.value)
    assert unchanged(before, template)  # the model was not loaded either
    # Built as at save time, the same optimizer loads and steps.
    model3 = torch.nn.Linear(3, 4)
    opt3 = opt_cls(model3.parameters(), **kw)
    asyncsave.load(path, {"model": model3, "optim": opt3})
    trained(model3, opt3, 1)


def test_an_optimizer_with_other_groups_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 4)
    opt = torch.optim.Adam(model.parameters())
    trained(model, opt)
    path = save(tmp_path, {"model": model, "optim": opt})
    model2 = torch.nn.Linear(3, 4)
    opt2 = torch.optim.Adam([{"params": [model2.weight]}, {"params": [model2.bias]}])
    template = {"model": model2, "optim": opt2}
    before = snapshot(template)
    with pytest.raises(asyncsave.TemplateMismatchError) as err:
        asyncsave.load(path, template, strict=False)
    assert err.value.key == "optim/param_groups" and "[2]" in str(err.value)
    assert unchanged(before, template)


def test_factored_optimizer_state_loads(tmp_path: Path) -> None:
    """Adafactor keeps row and column statistics (shapes (4, 1) and (1, 3) for a
    (4, 3) weight): they fit their parameter."""
    model = torch.nn.Linear(3, 4)
    opt = torch.optim.Adafactor(model.parameters())  # torch >= 2.5; asyncsave needs 2.6
    trained(model, opt)
    path = save(tmp_path, {"model": model, "optim": opt})
    model2 = torch.nn.Linear(3, 4)
    opt2 = torch.optim.Adafactor(model2.parameters())
    asyncsave.load(path, {"model": model2, "optim": opt2})
    assert torch.equal(opt2.state[model2.weight]["row_var"], opt.state[model.weight]["row_var"])


# -- order of restoring, and the resume entry points --------------------------------


class Refuses:
    """A Stateful object whose own loader refuses what the checkpoint holds."""

    def state_dict(self) -> dict[str, Any]:
        return {"v": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise ValueError("version 1 is too old")


def test_an_object_that_refuses_is_restored_before_checked_tensors(tmp_path: Path) -> None:
    """Objects asyncsave cannot check go first: when one refuses, the model and the
    tensors of the template are still untouched."""
    model = torch.nn.Linear(3, 4)
    path = save(tmp_path, {"model": model, "buf": torch.ones(3), "loader": Refuses()})
    template = {"model": torch.nn.Linear(3, 4), "buf": torch.zeros(3), "loader": Refuses()}
    before = snapshot(template)
    with pytest.raises(asyncsave.InvalidStateError) as err:
        asyncsave.load(path, template)
    assert err.value.key == "loader" and "too old" in str(err.value)
    assert "Refuses.load_state_dict()" in str(err.value)
    assert unchanged(before, template)


async def test_load_latest_applies_the_same_rule(tmp_path: Path) -> None:
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, {"model": _two_layers(), "evals": [1, 2, 3]}))
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        small = _one_layer()
        before = snapshot(small)
        with pytest.raises(asyncsave.TemplateMismatchError):
            await ckpt.load_latest({"model": small, "evals": []})
        assert unchanged(before, small)
        with pytest.warns(asyncsave.CheckpointWarning, match="model/1.weight") as record:
            restored = await ckpt.load_latest({"model": small, "evals": []}, strict=False)
        assert record[0].filename == __file__
        assert restored is not None and restored.state["evals"] == [1, 2, 3]
        assert torch.equal(small[0].weight, _two_layers()[0].weight)


def test_sync_load_latest_and_load_step_warn_on_the_callers_line(tmp_path: Path) -> None:
    save(tmp_path, {"model": _two_layers()})
    small = _one_layer()
    with asyncsave.SyncCheckpointer(tmp_path) as ckpt:
        with pytest.raises(asyncsave.TemplateMismatchError):
            ckpt.load_latest({"model": small})
        with pytest.warns(asyncsave.CheckpointWarning, match="model/1.bias") as record:
            assert ckpt.load_latest({"model": small}, strict=False) is not None
        assert record[0].filename == __file__
    with pytest.raises(asyncsave.TemplateMismatchError):
        asyncsave.load_step(tmp_path, 1, {"model": _one_layer()})
    with pytest.warns(asyncsave.CheckpointWarning, match="model/1.bias") as record:
        asyncsave.load_step(tmp_path, 1, {"model": _one_layer()}, strict=False)
    assert record[0].filename == __file__


def test_a_fitting_template_issues_no_warning(tmp_path: Path) -> None:
    path = save(tmp_path, {"model": _two_layers(), "step": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        asyncsave.load(path, {"model": _two_layers(), "step": 0}, strict=False)


def test_the_mismatch_error_keeps_its_keys_across_processes() -> None:
    err = asyncsave.TemplateMismatchError(
        "x", key="a", path="/p", step=3, missing=["m"], unexpected=["u"], mismatched=["a"]
    )
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is asyncsave.TemplateMismatchError
    assert (back.missing, back.unexpected, back.mismatched) == (("m",), ("u",), ("a",))
    assert (back.key, back.path, back.step, str(back)) == ("a", "/p", 3, "x")


# -- a checksum error says how to fall back ------------------------------------------


async def test_a_checksum_error_of_load_latest_says_how_to_fall_back(tmp_path: Path) -> None:
    for step in (1, 2):
        save(tmp_path, {"w": torch.full((64,), float(step)), "step": step}, step)
    data = sorted((tmp_path / "step_2").glob("*.safetensors"))[0]
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0x10
    data.write_bytes(bytes(raw))
    async with asyncsave.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(asyncsave.ChecksumMismatchError) as err:
            await ckpt.load_latest()
    assert "fallback=True" in str(err.value) and err.value.step == 2
    assert isinstance(err.value.__cause__, asyncsave.ChecksumMismatchError)
    with asyncsave.SyncCheckpointer(tmp_path) as sync:
        with pytest.raises(asyncsave.ChecksumMismatchError, match="fallback=True"):
            sync.load_latest()
        restored = sync.load_latest(fallback=True)
    assert restored is not None and restored.info.step == 1


# -- generated trees: either a typed error naming the key, template untouched, or a
# -- correct load --------------------------------------------------------------------

SHAPES = [(), (3,), (2, 3)]
DTYPES = [torch.float32, torch.int64, torch.bfloat16]


def _tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n) + 1).reshape(shape).to(dtype)


LEAVES = st.one_of(
    st.builds(_tensor, st.sampled_from(SHAPES), st.sampled_from(DTYPES)),
    st.integers(-5, 5),
    st.text(max_size=3),
    st.lists(st.integers(0, 9), max_size=3),
)
TREES = st.dictionaries(
    st.sampled_from("abcd"),
    st.recursive(
        LEAVES, lambda kids: st.dictionaries(st.sampled_from("abc"), kids, min_size=1, max_size=3)
    ),
    min_size=1,
    max_size=4,
)


def _paths(tree: Any, where: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for k, v in tree.items():
        yield (*where, k), v
        if isinstance(v, dict):
            yield from _paths(v, (*where, k))


def _template_of(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: _template_of(v) for k, v in tree.items()}
    return [] if isinstance(tree, list) else -1  # plain: any placeholder


def _at(tree: Any, path: tuple[str, ...]) -> Any:
    for k in path[:-1]:
        tree = tree[k]
    return tree


def _tensor_keys(tree: Any, where: tuple[str, ...]) -> set[str]:
    if isinstance(tree, torch.Tensor):
        return {"/".join(where)}
    if isinstance(tree, dict):
        return {k for key, v in tree.items() for k in _tensor_keys(v, (*where, key))}
    return set()


def _mutate(data: st.DataObject, saved: Any, template: Any) -> tuple[str, set[str]]:
    """One change to ``template``: its kind and the keys an error must name."""
    paths = list(_paths(saved))
    kind = data.draw(st.sampled_from(["none", "drop", "add", "reshape", "retype", "relist"]))
    if kind == "drop":
        path, value = data.draw(st.sampled_from(paths))
        del _at(template, path)[path[-1]]
        if len(path) == 1 and not any(isinstance(v, torch.Tensor) for v in template.values()):
            return kind, set()  # a top-level item left out: returned as saved
        return kind, _tensor_keys(value, path)
    if kind == "add":
        dicts = [()] + [p for p, v in paths if isinstance(v, dict)]
        where = data.draw(st.sampled_from(dicts))
        node = _at(template, (*where, "_"))
        node["zz"] = data.draw(st.sampled_from([torch.zeros(2), 0, [1]]))
        return kind, {"/".join((*where, "zz"))}
    leaves = [(p, v) for p, v in paths if isinstance(v, torch.Tensor)]
    if kind in ("reshape", "retype") and leaves:
        path, value = data.draw(st.sampled_from(leaves))
        if kind == "retype":
            other = torch.zeros(value.shape, dtype=torch.float64)
        else:
            other = torch.zeros((*value.shape, 2), dtype=value.dtype)
        _at(template, path)[path[-1]] = other
        return kind, {"/".join(path)}
    lists = [p for p, v in paths if isinstance(v, list)]
    if kind == "relist" and lists:
        path = data.draw(st.sampled_from(lists))
        _at(template, path)[path[-1]] = data.draw(st.lists(st.integers(), max_size=4))
    return "none", set()


def _fits(out: Any, saved: Any) -> bool:
    if isinstance(saved, torch.Tensor):
        return torch.equal(out, saved)
    if isinstance(saved, dict):
        return all(_fits(out[k], v) for k, v in saved.items())
    return bool(out == saved)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(saved=TREES, data=st.data())
def test_generated_templates_either_load_exactly_or_fail_naming_the_key(
    saved: dict[str, Any], data: st.DataObject
) -> None:
    template = _template_of(saved)
    kind, keys = _mutate(data, saved, template)
    before = snapshot(template)
    with tempfile.TemporaryDirectory() as tmp:
        path = save(Path(tmp), saved)
        if kind == "add":
            with pytest.raises(asyncsave.MissingItemError) as missing:
                asyncsave.load(path, template)
            assert missing.value.key in keys and unchanged(before, template)
            return
        if kind in ("reshape", "retype") or (kind == "drop" and keys):
            with pytest.raises(asyncsave.TemplateMismatchError) as err:
                asyncsave.load(path, template)
            found = err.value.mismatched if kind != "drop" else err.value.unexpected
            assert set(found) == keys and unchanged(before, template)
            return
        out = asyncsave.load(path, template)
    assert _fits(out, saved)
    for p, value in _paths(saved):  # every template tensor was filled in place
        node: Any = template
        for k in p:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(value, torch.Tensor) and node is not None:
            assert torch.equal(node, value)


# -- Stateful wrappers: what their state_dict() holds now is checked by the same rule
# -- (DCP's "AppState" pattern:
# -- https://pytorch.org/tutorials/recipes/distributed_checkpoint_recipe.html) ------


class AppState:
    """DCP's documented wrapper: a model and an optimizer behind one state_dict()."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.optim.load_state_dict(sd["optim"])


class Outer:
    """A wrapper around a wrapper, with a plain counter of its own."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.inner, self.epoch = AppState(model, optim), 0

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "epoch": self.epoch}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.inner.load_state_dict(sd["inner"])
        self.epoch = sd["epoch"]


class Objects(AppState):
    """A wrapper whose state_dict() hands back the objects themselves."""

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.optim}


class Copied(AppState):
    """A wrapper that copies the optimizer's state: its maker is not known."""

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": copy.deepcopy(self.optim.state_dict())}


WRAPPERS: dict[str, tuple[Any, str]] = {
    "app state": (AppState, "app/"),
    "nested wrappers": (Outer, "app/inner/"),
    "objects in state": (Objects, "app/"),
    "copied optimizer state": (Copied, "app/"),
}


def _pair(layers: int = 2, swap: bool = False, steps: int = 1) -> tuple[Any, Any]:
    torch.manual_seed(0)
    sizes = [3, 4, 2, 2][: layers + 1]
    model = torch.nn.Sequential(*(torch.nn.Linear(a, b) for a, b in itertools.pairwise(sizes)))
    params = list(model.parameters())
    if swap:
        params[0], params[1] = params[1], params[0]
    opt = torch.optim.Adam(params, lr=1e-3)
    trained(model, opt, steps)
    return model, opt


def _saved_wrapper(tmp_path: Path, shape: str) -> Path:
    wrap, _ = WRAPPERS[shape]
    return save(tmp_path, {"app": wrap(*_pair(steps=2)), "step": 3})


@pytest.mark.parametrize("shape", sorted(WRAPPERS))
@pytest.mark.parametrize("change", ["swapped", "grown", "shrunk"])
def test_a_stateful_wrapper_that_does_not_fit_is_refused_before_anything_changes(
    tmp_path: Path, shape: str, change: str
) -> None:
    """Two parameters swapped in the optimizer (it used to load, and the next
    step() crashed), a model that grew or lost a layer (its first layer used to be
    overwritten before the wrapper's loader refused): a typed error naming the
    key inside the wrapper, model and optimizer untouched."""
    path = _saved_wrapper(tmp_path, shape)
    wrap, prefix = WRAPPERS[shape]
    layers = {"grown": 3, "shrunk": 1}.get(change, 2)
    model, opt = _pair(layers, swap=change == "swapped")
    before = snapshot({"model": model, "optim": opt})
    with pytest.raises(asyncsave.TemplateMismatchError) as err:
        asyncsave.load(path, {"app": wrap(model, opt)})
    assert str(err.value.key).startswith(prefix), err.value.key
    assert repr(err.value.key) in str(err.value)
    assert unchanged(before, {"model": model, "optim": opt})


@pytest.mark.parametrize("shape", sorted(set(WRAPPERS) - {"copied optimizer state"}))
def test_a_fresh_optimizer_with_swapped_parameters_in_a_wrapper_is_refused(
    tmp_path: Path, shape: str
) -> None:
    """At resume the optimizer holds no state yet: its saved state is checked
    against its parameters, which the wrapper's optimizer is reached for."""
    path = _saved_wrapper(tmp_path, shape)
    wrap, prefix = WRAPPERS[shape]
    model, opt = _pair(swap=True, steps=0)
    with pytest.raises(asyncsave.TemplateMismatchError) as err:
        asyncsave.load(path, {"app": wrap(model, opt)})
    assert err.value.mismatched and all(
        k.startswith(f"{prefix}optim/state/") for k in err.value.mismatched
    )
    assert "parameter of shape" in str(err.value)
    assert not opt.state  # not loaded


@pytest.mark.parametrize("shape", sorted(WRAPPERS))
def test_a_fitting_stateful_wrapper_loads_through_its_own_loader(
    tmp_path: Path, shape: str
) -> None:
    wrap, _ = WRAPPERS[shape]
    saved_model, saved_opt = _pair(steps=2)
    path = save(tmp_path, {"app": wrap(saved_model, saved_opt), "step": 3})
    model, opt = _pair(steps=0)
    app = wrap(model, opt)
    out = asyncsave.load(path, {"app": app})
    assert out["app"] is app and out["step"] == 3
    pairs = zip(model.parameters(), saved_model.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert opt.state_dict()["state"].keys() == saved_opt.state_dict()["state"].keys()
    trained(model, opt, 1)  # the optimizer's state belongs to the right parameters


@pytest.mark.parametrize(
    "state",
    [{"epoch": 3, "name": "run"}, {"seen": [1, 2, 3]}, {}],
    ids=["numbers", "list", "empty"],
)
def test_a_wrapper_of_plain_values_is_left_to_its_own_loader(
    tmp_path: Path, state: dict[str, Any]
) -> None:
    """Nothing to check (no tensor): the object's own loader is given the saved
    state, whatever it holds now."""

    class Plain:
        def __init__(self, sd: dict[str, Any]) -> None:
            self.sd = sd

        def state_dict(self) -> dict[str, Any]:
            return self.sd

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.sd = dict(sd)

    path = save(tmp_path, {"loader": Plain(state)})
    fresh = Plain({"other": "keys"})
    asyncsave.load(path, {"loader": fresh})
    assert fresh.sd == state


class ModelOnly:
    """A wrapper with a strict loader of its own (a module's default)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "epoch": 1}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])


@pytest.mark.parametrize(("layers", "kind"), [(3, "missing"), (1, "unexpected"), (2, None)])
def test_strict_false_reaches_a_wrappers_own_strict_loader(
    tmp_path: Path, layers: int, kind: str | None
) -> None:
    """strict=True: the missing or unexpected layers are a typed error, nothing
    loaded; strict=False: the layers that match are loaded (the wrapper's own
    loader is given its current state where the checkpoint has none, and not the
    saved layers it lacks), the rest named in one warning."""
    saved, _ = _pair(steps=0)
    path = save(tmp_path, {"app": ModelOnly(saved)})
    model, _ = _pair(layers, steps=0)
    torch.nn.init.zeros_(model[0].weight)
    grown = model[2].weight.clone() if layers == 3 else None
    if kind is not None:
        error = asyncsave.MissingItemError if kind == "missing" else asyncsave.TemplateMismatchError
        with pytest.raises(error) as err:
            asyncsave.load(path, {"app": ModelOnly(model)})
        assert str(err.value.key).startswith("app/model/") and kind in str(err.value)
        assert not model[0].weight.any()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        asyncsave.load(path, {"app": ModelOnly(model)}, strict=False)
    assert torch.equal(model[0].weight, saved[0].weight)
    if grown is not None:
        assert torch.equal(model[2].weight, grown)  # its own, untouched
    notes = [str(w.message) for w in record if issubclass(w.category, asyncsave.CheckpointWarning)]
    assert (kind is None) == (not notes)
    if kind is not None:
        assert f"{kind} item(s) 'app/model/" in notes[0]


class TreeState:
    """A wrapper over a tree of tensors and plain values: state_dict() hands out
    the tree itself; load_state_dict() copies into its tensors and refuses a
    missing key, as a strict loader does."""

    def __init__(self, tree: dict[str, Any]) -> None:
        self.tree = tree

    def state_dict(self) -> dict[str, Any]:
        return self.tree

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        _fill(self.tree, sd)


def _fill(tree: dict[str, Any], sd: dict[str, Any]) -> None:
    if tree.keys() - sd.keys():
        raise KeyError(f"missing {sorted(tree.keys() - sd.keys())}")
    for k, v in sd.items():
        if isinstance(tree.get(k), torch.Tensor):
            tree[k].copy_(v)
        elif isinstance(tree.get(k), dict) and isinstance(v, dict):
            _fill(tree[k], v)
        else:
            tree[k] = v


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(saved=TREES, data=st.data())
def test_generated_trees_behind_a_wrapper_follow_the_same_rule(
    saved: dict[str, Any], data: st.DataObject
) -> None:
    """The generated trees of the test above, behind a Stateful wrapper: the same
    typed errors naming the same keys (under the wrapper's), nothing changed in
    place; or a correct load through the wrapper's own loader. A top-level item the
    wrapper's state lacks counts as unexpected: it is the wrapper's whole state."""
    template = _template_of(saved)
    kind, keys = _mutate(data, saved, template)
    if kind == "drop" and not keys:  # a top-level item, returned as saved by a plain tree
        dropped = _tensor_keys(saved, ()) - _tensor_keys(template, ())
        keys = dropped
    assume(bool(_tensor_keys(template, ())))  # no tensor: nothing to check, its loader decides
    keys = {f"app/{k}" for k in keys}
    before = snapshot(template)
    with tempfile.TemporaryDirectory() as tmp:
        path = save(Path(tmp), {"app": TreeState(saved)})
        if kind == "add":
            with pytest.raises(asyncsave.MissingItemError) as missing:
                asyncsave.load(path, {"app": TreeState(template)})
            assert missing.value.key in keys and unchanged(before, template)
            return
        if kind in ("reshape", "retype") or (kind == "drop" and keys):
            with pytest.raises(asyncsave.TemplateMismatchError) as err:
                asyncsave.load(path, {"app": TreeState(template)})
            found = err.value.mismatched if kind != "drop" else err.value.unexpected
            assert set(found) == keys and unchanged(before, template)
            return
        tensors = {p: v for p, v in _paths(template) if isinstance(v, torch.Tensor)}
        asyncsave.load(path, {"app": TreeState(template)})
    assert _fits(template, saved)
    assert all(_at(template, p)[p[-1]] is t for p, t in tensors.items())  # filled in place


class RNGOfTwoDevices(asyncsave.RNGState):
    """The RNG state as a machine with two CUDA devices saves it."""

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "cuda": [torch.get_rng_state(), torch.get_rng_state()]}


def test_rng_state_of_another_device_count_is_left_to_its_own_loader(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RNGState restores the CUDA devices both runs have: the states of devices
    this machine lacks are no unexpected items of a template."""
    torch.manual_seed(7)
    path = save(tmp_path, {"rng": RNGOfTwoDevices()})
    expected = torch.rand(3)
    torch.manual_seed(0)
    asyncsave.load(path, {"rng": asyncsave.RNGState()})
    assert torch.equal(torch.rand(3), expected)
    assert "saved 2 CUDA device states" in caplog.text
