"""What ``save()`` writes, ``load_latest()`` resumes: DTensor (FSDP2) state, which
goes through DCP's planner, comes back through ``Checkpointer.load_latest(template)``
in place, at the same world size and resharded to another, with the agreed resume,
``fallback=`` and ``required=``; the readers that cannot read it say what does, and
the command lists its tensors."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException

import asyncsave
from asyncsave import CheckpointOptions
from asyncsave.dcp import StorageReader, StorageWriter
from asyncsave.testing import cli as cli_main
from asyncsave.testing import encode_manifest

sys.path.insert(0, str(Path(__file__).parent))
from distributed import run_ranks, values

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]


def _tensor(seed: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, int(torch.Size(shape).numel())) * 8,), generator=g)
    n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
    return raw.to(torch.uint8)[:n].view(dtype).reshape(shape).clone()


def _zeros(tree: Any) -> Any:
    """The template a fresh run builds: same structure, tensors zeroed, plain
    leaves at their defaults."""
    if isinstance(tree, dict):
        return {k: _zeros(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_zeros(v) for v in tree]
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    return type(tree)()


def _same(a: Any, b: Any) -> bool:
    """Bit for bit: same structure, dtypes, shapes and bytes."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    return bool(a == b)


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, list):
        return [t for v in tree for t in _tensors(v)]
    return [tree] if isinstance(tree, torch.Tensor) else []


def _load_latest(root: Path, template: Any, **kwargs: Any) -> Any:
    options = kwargs.pop("options", None)

    async def main() -> Any:
        async with asyncsave.Checkpointer(root, options=options) as ckpt:
            return await ckpt.load_latest(template, **kwargs)

    return anyio.run(main)


def _save_dcp(root: Path, step: int, state: dict[str, Any]) -> Path:
    dcp.save(state, storage_writer=StorageWriter(root, step=step))
    return root / f"step_{step}"


_shapes = st.sampled_from([(), (0,), (3,), (2, 5), (4, 1, 3)])
_leaf = st.one_of(
    st.builds(_tensor, st.integers(0, 2**16), st.sampled_from(DTYPES), _shapes),
    st.integers(-(2**40), 2**40),
    st.text(max_size=8),
)
_key = st.one_of(st.sampled_from(["w", "b", "state", "exp_avg", "x_y"]), st.integers(0, 5))
_tree = st.recursive(
    _leaf,
    lambda sub: st.one_of(
        st.dictionaries(_key, sub, min_size=1, max_size=4),
        st.lists(sub, min_size=1, max_size=3),
    ),
    max_leaves=12,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.dictionaries(st.sampled_from(["model", "optim", "trainer", "7"]), _tree, min_size=1))
def test_load_latest_restores_a_dcp_checkpoint_into_the_template_in_place(
    state: dict[str, Any],
) -> None:
    # Nested dicts with int keys (an optimizer's state), lists of tensors, plain
    # leaves, every dtype, 0-d and empty tensors: what dcp.save wrote, load_latest
    # restores, the template's tensors filled in place.
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _save_dcp(root, 3, state)
        template = _zeros(state)
        restored = _load_latest(root, template)
        assert restored.info.step == 3
        assert _same(state, restored.state)
        # The template's own tensors hold the saved bytes.
        assert _same(_tensors(state), _tensors(template))


def test_load_latest_of_a_dcp_checkpoint_refuses_before_changing_anything(
    tmp_path: Path,
) -> None:
    state = {
        "model": {"w": torch.randn(4, 3), "b": torch.arange(3.0)},
        "trainer": {"step": 7},
    }
    _save_dcp(tmp_path, 7, state)
    cases: list[tuple[Any, dict[str, Any], type[Exception], str]] = [
        # a key the checkpoint lacks
        (
            {"model": {"w": torch.zeros(4, 3), "gone": torch.zeros(2)}},
            {},
            asyncsave.MissingItemError,
            "model/gone",
        ),
        # another global shape, another dtype
        ({"model": {"w": torch.zeros(3, 4)}}, {}, asyncsave.InvalidStateError, "model/w"),
        (
            {"model": {"b": torch.zeros(3, dtype=torch.float64)}},
            {},
            asyncsave.InvalidStateError,
            "model/b",
        ),
        # a tensor where a plain value was saved
        (
            {"model": {"w": torch.zeros(4, 3)}, "trainer": {"step": torch.zeros(())}},
            {},
            asyncsave.InvalidStateError,
            "trainer/step",
        ),
        # required items are checked against the checkpoint, not the template
        (
            {"model": {"w": torch.zeros(4, 3)}},
            {"required": ["trainer/rng"]},
            asyncsave.MissingItemError,
            "trainer/rng",
        ),
        # no template: DTensor state needs the tensors that say how it is sharded
        (None, {}, asyncsave.UnsupportedFormatError, "template"),
    ]
    for template, kwargs, error, key in cases:
        with pytest.raises(error, match=key) as info:
            _load_latest(tmp_path, template, **kwargs)
        assert "step_7" in str(info.value) or info.value.key == key
        if template is not None:
            for t in template["model"].values():
                assert not t.any(), "changed in place before the refusal"
    # A required item the template does not hold, but the checkpoint does, is fine.
    template = {"model": {"w": torch.zeros(4, 3)}}
    restored = _load_latest(tmp_path, template, required=["trainer/step", "model/b"])
    assert torch.equal(template["model"]["w"], state["model"]["w"])
    assert restored.info.step == 7


def test_damaged_dcp_checkpoint_raises_or_falls_back_leaving_the_template(
    tmp_path: Path,
) -> None:
    old = {"w": torch.randn(64), "n": 1}
    new = {"w": torch.randn(64), "n": 2}
    _save_dcp(tmp_path, 1, old)
    damaged = _save_dcp(tmp_path, 2, new)
    data = damaged / "data-r00000-000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF
    data.write_bytes(bytes(raw))
    template = {"w": torch.zeros(64), "n": 0}
    with pytest.raises(asyncsave.ChecksumMismatchError, match=r"step_2.*checksum"):
        _load_latest(tmp_path, template)
    assert not template["w"].any()  # nothing changed in place
    restored = _load_latest(tmp_path, template, fallback=True)
    assert restored.info.step == 1 and restored.state["n"] == 1
    assert torch.equal(template["w"], old["w"])
    assert not damaged.exists()  # moved aside, kept
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".asyncsave-damaged-")]


class Opaque:
    """A plain value only pickle can rebuild."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.n == self.n


def test_a_pickled_plain_value_loads_only_with_allow_pickle(tmp_path: Path) -> None:
    _save_dcp(tmp_path, 1, {"w": torch.ones(2), "obj": Opaque(5), "betas": (0.9, 0.99)})
    template = {"w": torch.zeros(2), "obj": None, "betas": (0.0, 0.0)}
    with pytest.raises(asyncsave.UnsafeLoadError, match="'obj'") as info:
        _load_latest(tmp_path, template)
    assert info.value.key == "obj" and not template["w"].any()
    restored = _load_latest(tmp_path, template, options=CheckpointOptions(allow_pickle=True))
    assert restored.state["obj"] == Opaque(5) and restored.state["betas"] == (0.9, 0.99)


class _Planted:
    def __reduce__(self) -> Any:
        return (os.mkdir, (str(_Planted.marker),))

    marker = Path("/nonexistent")


def test_a_forged_dcp_metadata_runs_no_code(tmp_path: Path) -> None:
    path = _save_dcp(tmp_path / "run", 1, {"w": torch.ones(2)})
    _Planted.marker = tmp_path / "planted"
    blob = pickle.dumps(_Planted())
    (path / ".metadata").write_bytes(blob)
    doc = json.loads((path / "manifest.json").read_bytes())
    doc.pop("manifest_xxh3_64")  # resealed below, as a forger would
    doc["dcp_metadata"].update(nbytes=len(blob), xxh3_64=xxhash.xxh3_64_hexdigest(blob))
    (path / "manifest.json").write_bytes(encode_manifest(doc))
    with pytest.raises(asyncsave.CorruptCheckpointError, match="no DCP Metadata"):
        _load_latest(tmp_path / "run", {"w": torch.zeros(2)})
    with pytest.raises(CheckpointException, match="no DCP Metadata"):
        dcp.load({"w": torch.zeros(2)}, storage_reader=StorageReader(path))
    assert cli_main(["inspect", str(path)], out=io.StringIO()) == 1
    assert not _Planted.marker.exists()


def test_load_and_load_tensors_refuse_a_dcp_checkpoint_saying_what_reads_it(
    tmp_path: Path,
) -> None:
    path = _save_dcp(tmp_path, 2, {"model": {"w": torch.ones(3)}, "step": 2})
    messages = []
    for call in (
        lambda: asyncsave.load(path),
        lambda: asyncsave.load_tensors(path, ["model/w"]),
        lambda: asyncsave.load_tensors(path, ["model"]),
    ):
        with pytest.raises(asyncsave.UnsupportedFormatError) as info:
            call()
        messages.append(str(info.value))
    assert len(set(messages)) == 1
    assert "load_latest(template)" in messages[0] and "StorageReader" in messages[0]


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    rc = cli_main(list(argv), out=out)
    return rc, out.getvalue()


def test_cli_lists_the_tensors_and_keys_of_a_dcp_checkpoint(tmp_path: Path) -> None:
    state = {
        "w": torch.randn(16, 8),
        "half": torch.randn(5, dtype=torch.bfloat16),
        "optim": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
        "extra": {"step": 5, "name": "run"},
    }
    path = _save_dcp(tmp_path, 5, state)
    rc, out = _cli("ls", str(tmp_path))
    assert rc == 0 and "3 tensors" in out and "torch.distributed.checkpoint" in out
    rc, out = _cli("verify", str(path))
    assert rc == 0 and "3 tensors" in out
    rc, out = _cli("inspect", str(path))
    assert rc == 0 and "3 tensors" in out
    for line in (
        "w: float32 [16, 8]",
        "half: bfloat16 [5]",
        "optim/state/0/step: float32 []",
        "optim/param_groups/0/lr: plain value",
        "extra/name: plain value",
    ):
        assert line in out, out


# -- FSDP2 on 2 gloo ranks (CPU) ----------------------------------------------------


def _model(world: int, seed: int, shard: bool = True) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if shard:
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: Any, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 8, generator=g)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _full(state: Any) -> Any:
    """The state with every DTensor gathered whole (collective), on the CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: _full(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_full(v) for v in state]
    if isinstance(state, DTensor):
        return state.full_tensor().detach().clone()
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    return state


def _pack(state: Any) -> bytes:
    """Tensors cross the pipe from a rank as bytes (a tensor would go through shared
    memory, which a rank that exits at once takes with it)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _unpack(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=True)


def _snapshot(model: torch.nn.Module, opt: Any) -> dict[str, Any]:
    return {"model": _full(model.state_dict()), "optim": _full(opt.state_dict())}


def _flip_an_item(path: Path, file: str) -> None:
    """Flip one byte in the middle of the first item the manifest places in ``file``."""
    doc = json.loads((path / "manifest.json").read_bytes())
    index = [f["name"] for f in doc["files"]].index(file)
    entry = next(e for e in doc["entries"] if e["file"] == index and e["nbytes"] > 0)
    data = path / file
    raw = bytearray(data.read_bytes())
    raw[entry["offset"] + entry["nbytes"] // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def _save_and_resume_on_two(rank: int, world: int, root: str) -> dict[str, Any]:
    """Train and save steps 2 and 3 through Checkpointer.save (DTensor state); resume
    a fresh model and optimizer from them, also from a copy damaged in rank 1's
    file, with and without fallback; ``required``."""
    import torch.distributed as dist

    model, opt = _model(world, seed=0)
    seen: dict[str, Any] = {}

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with asyncsave.Checkpointer(root, dist_timeout_s=60) as ckpt:
            for step in (1, 2, 3):
                _train(model, opt, step)
                if step >= 2:
                    await (
                        await ckpt.save(
                            step, {"model": model, "optim": opt, "trainer": {"step": step}}
                        )
                    )
                    seen[step] = _snapshot(model, opt)
        damaged = root + "-damaged"
        if rank == 0:
            shutil.copytree(root, damaged)
            _flip_an_item(Path(damaged) / "step_3", "data-r00001-000.safetensors")
        dist.barrier()
        fresh, fresh_opt = _model(world, seed=1)
        template = {"model": fresh, "optim": fresh_opt, "trainer": {"step": 0}}
        async with asyncsave.Checkpointer(root, dist_timeout_s=60) as ckpt:
            with pytest.raises(asyncsave.MissingItemError, match="trainer/rng"):
                await ckpt.load_latest(template, required=["trainer/rng"])
            restored = await ckpt.load_latest(template, required=["trainer/step"])
            out["same_world"] = (restored.info.step, restored.state["trainer"]["step"])
            out["same_world_exact"] = _same(seen[3], _snapshot(fresh, fresh_opt))
            out["resumed_step"] = ckpt.resumed_step
        fresh, fresh_opt = _model(world, seed=2)
        template = {"model": fresh, "optim": fresh_opt}
        async with asyncsave.Checkpointer(damaged, dist_timeout_s=60) as ckpt:
            with pytest.raises(asyncsave.CorruptCheckpointError) as info:
                await ckpt.load_latest(template)
            out["damaged_rank"] = info.value.rank
            restored = await ckpt.load_latest(template, fallback=True)
            out["fallback"] = restored.info.step
            out["fallback_exact"] = _same(seen[2], _snapshot(fresh, fresh_opt))
        return out

    out = anyio.run(main)
    out["seen"] = _pack(seen) if rank == 0 else None
    return out


def _resume_on_one_and_save(rank: int, world: int, root: str, seen: Any) -> dict[str, Any]:
    """2 -> 1: an unsharded model and a 1-rank FSDP2 model resume step 3; the
    latter trains and saves step 4 (DTensor state of one rank)."""
    out: dict[str, Any] = {}
    plain, plain_opt = _model(world, seed=5, shard=False)
    restored = _load_latest(Path(root), {"model": plain, "optim": plain_opt})
    out["plain"] = (restored.info.step, _same(seen[3], _snapshot(plain, plain_opt)))
    model, opt = _model(world, seed=6)

    async def main() -> None:
        async with asyncsave.Checkpointer(root) as ckpt:
            restored = await ckpt.load_latest({"model": model, "optim": opt})
            out["fsdp_one"] = (restored.info.step, _same(seen[3], _snapshot(model, opt)))
            _train(model, opt, 4)
            await (await ckpt.save(4, {"model": model, "optim": opt}))

    anyio.run(main)
    out["seen4"] = _pack(_snapshot(model, opt))
    return out


def _resume_on_two(rank: int, world: int, root: str, seen4: Any) -> bool:
    """1 -> 2: the step 4 saved by one rank resumes sharded over two."""
    model, opt = _model(world, seed=9)
    restored = _load_latest(Path(root), {"model": model, "optim": opt})
    return restored.info.step == 4 and _same(seen4, _snapshot(model, opt))


@pytest.mark.slow
def test_fsdp2_state_saved_by_checkpointer_resumes_through_load_latest_at_2_1_and_2(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "run")
    on_two = values(run_ranks(_save_and_resume_on_two, 2, tmp_path, root, timeout_s=300))
    for out in on_two:
        assert out["same_world"] == (3, 3) and out["same_world_exact"]
        assert out["resumed_step"] == 3
        assert out["damaged_rank"] == 1  # rank 1's part is the damaged one, on both ranks
        assert out["fallback"] == 2 and out["fallback_exact"]
    seen = _unpack(on_two[0]["seen"])
    # The command counts each tensor once, however many ranks hold shards of it.
    rc, listed = _cli("inspect", str(Path(root) / "step_3"))
    assert rc == 0 and "world size 2, 16 tensors" in listed, listed
    assert "model/0.weight: float32 [16, 8]" in listed
    (on_one,) = values(run_ranks(_resume_on_one_and_save, 1, tmp_path, root, seen, timeout_s=300))
    assert on_one["plain"] == (3, True) and on_one["fsdp_one"] == (3, True)
    seen4 = _unpack(on_one["seen4"])
    assert values(run_ranks(_resume_on_two, 2, tmp_path, root, seen4, timeout_s=300)) == [
        True,
        True,
    ]
