"""``asyncsave.export_hf`` and ``asyncsave export --format hf``: a checkpoint's model
weights as a directory that ``transformers``' ``from_pretrained`` loads."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import anyio
import pytest
import safetensors.torch
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import asyncsave
from asyncsave.testing import FakeGroup, cli

pytestmark = pytest.mark.anyio

transformers.logging.set_verbosity_error()  # GPT2's bos/eos ids past a tiny vocabulary


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    return GPT2LMHeadModel(config).eval()


def logits(model: GPT2LMHeadModel) -> torch.Tensor:
    ids = torch.arange(24).remainder(100).view(2, 12)
    with torch.no_grad():
        return model(ids).logits


async def save_trained(root: Path, model: GPT2LMHeadModel, step: int = 3) -> Path:
    """A checkpoint as a trainer writes it: model, optimizer, plain values."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    loss = model(torch.arange(16).view(2, 8), labels=torch.arange(16).view(2, 8)).loss
    loss.backward()
    opt.step()
    model.eval()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
    async with asyncsave.Checkpointer(root) as ckpt:
        info = await (await ckpt.save(step, state))
    return info.path


async def test_an_export_loads_with_from_pretrained_and_gives_equal_logits(tmp_path: Path) -> None:
    model = tiny_gpt2()
    path = await save_trained(tmp_path / "run", model)
    out = tmp_path / "hf"
    written = asyncsave.export_hf(path, out, config=model.config)
    assert [f.name for f in written] == ["model.safetensors", "config.json"]
    loaded = GPT2LMHeadModel.from_pretrained(out).eval()
    assert torch.equal(logits(loaded), logits(model))
    # Tied weights: under each name, and tied again by from_pretrained.
    weights = safetensors.torch.load_file(out / "model.safetensors")
    assert torch.equal(weights["lm_head.weight"], weights["transformer.wte.weight"])
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    assert set(weights) == set(model.state_dict())


async def test_a_sharded_export_has_an_index_and_loads(tmp_path: Path) -> None:
    model = tiny_gpt2()
    path = await save_trained(tmp_path / "run", model)
    out = tmp_path / "hf"
    written = asyncsave.export_hf(path, out, config=model.config, max_shard_bytes="20KB")
    shards = [f for f in written if f.suffix == ".safetensors"]
    assert len(shards) > 2 and shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    assert all(f.stat().st_size < 20_000 + 13_000 for f in shards)  # wte alone is 12,800 B
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    assert set(index["weight_map"].values()) == {f.name for f in shards}
    stored = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert index["metadata"]["total_size"] == stored
    assert not (out / "model.safetensors").exists()
    loaded = GPT2LMHeadModel.from_pretrained(out).eval()
    assert torch.equal(logits(loaded), logits(model))


async def test_dtype_casts_floating_weights_only(tmp_path: Path) -> None:
    state = {"model": {"w": torch.randn(4, 4), "ids": torch.arange(3)}, "step": 1}
    async with asyncsave.Checkpointer(tmp_path / "run") as ckpt:
        info = await (await ckpt.save(1, state))
    asyncsave.export_hf(info.path, tmp_path / "hf", dtype=torch.bfloat16)
    weights = safetensors.torch.load_file(tmp_path / "hf" / "model.safetensors")
    assert weights["w"].dtype == torch.bfloat16
    assert torch.equal(weights["w"], state["model"]["w"].bfloat16())
    assert weights["ids"].dtype == torch.int64 and torch.equal(weights["ids"], torch.arange(3))


async def test_dtype_leaves_quantized_floats_as_saved(tmp_path: Path) -> None:
    # An FP8 weight with its float32 scale and an MX (e8m0) scale: a cast would
    # drop what the scales mean, or overflow (2**127 is inf in float16); a float4
    # tensor cannot be cast at all. Only the wide floats are cast.
    fp8 = torch.randn(4, 4).to(torch.float8_e4m3fn)
    e8m0 = torch.tensor([2.0**-100, 1.0, 2.0**127]).to(torch.float8_e8m0fnu)
    fp4 = torch.randint(0, 256, (2, 3), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    model = {"w": fp8, "w_scale": torch.rand(4), "mx": e8m0, "fp4": fp4, "ln": torch.randn(4)}
    async with asyncsave.Checkpointer(tmp_path / "run") as ckpt:
        info = await (await ckpt.save(1, {"model": model}))
    asyncsave.export_hf(info.path, tmp_path / "hf", dtype=torch.float16)
    weights = safetensors.torch.load_file(tmp_path / "hf" / "model.safetensors")
    for key in ("w", "mx", "fp4"):
        got, want = weights[key], model[key]
        assert got.dtype == want.dtype, key
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), key
    assert weights["w_scale"].dtype == weights["ln"].dtype == torch.float16
    assert torch.equal(weights["ln"], model["ln"].half())


async def test_a_dtype_that_is_not_a_wide_float_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    async with asyncsave.Checkpointer(tmp_path / "run") as ckpt:
        info = await (await ckpt.save(1, {"model": {"w": torch.randn(2)}}))
    with pytest.raises(TypeError, match=r"torch\.dtype"):
        asyncsave.export_hf(info.path, tmp_path / "a", dtype="bfloat16")  # type: ignore[arg-type]
    for bad in (torch.int8, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match="bfloat16"):
            asyncsave.export_hf(info.path, tmp_path / "a", dtype=bad)
    assert not (tmp_path / "a").exists()


async def test_the_config_written_says_the_dtype_the_weights_were_cast_to(tmp_path: Path) -> None:
    # A float32 config (as AutoConfig gives for a float32 base): from_pretrained
    # loads the model in the dtype the config names, as save_pretrained writes it.
    model = tiny_gpt2()
    model.config.dtype = "float32"
    path = await save_trained(tmp_path / "run", model)
    out = tmp_path / "hf"
    asyncsave.export_hf(path, out, config=model.config, dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = GPT2LMHeadModel.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16
    # A transformers 4 config.json names it torch_dtype: both say it.
    v4 = {**model.config.to_dict(), "torch_dtype": "float32"}
    v4.pop("dtype")
    asyncsave.export_hf(path, tmp_path / "v4", config=v4, dtype=torch.float16)
    doc = json.loads((tmp_path / "v4" / "config.json").read_text())
    assert doc["torch_dtype"] == doc["dtype"] == "float16"
    # Without dtype=, the config is written as given.
    asyncsave.export_hf(path, tmp_path / "as-is", config=v4)
    written = json.loads((tmp_path / "as-is" / "config.json").read_text())
    assert written == json.loads(json.dumps(v4))  # JSON: keys as strings


async def test_two_keys_that_export_under_one_name_are_refused_naming_both(
    tmp_path: Path,
) -> None:
    # "a/b" (nested dicts) and "a.b" (a dotted key) are both "a.b" in the export:
    # written as they came, one of them would be lost without a word.
    state = {"model": {"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}, "c": torch.ones(1)}}
    async with asyncsave.Checkpointer(tmp_path / "run") as ckpt:
        info = await (await ckpt.save(1, state))
    with pytest.raises(asyncsave.InvalidKeyError, match=r"'a\.b'") as err:
        asyncsave.export_hf(info.path, tmp_path / "hf")
    assert "model/a.b" in str(err.value) and "model/a/b" in str(err.value)
    assert err.value.key in ("model/a.b", "model/a/b")
    assert not (tmp_path / "hf").exists()
    asyncsave.export_hf(info.path, tmp_path / "sub", key="model/a")  # one item at a time
    assert set(safetensors.torch.load_file(tmp_path / "sub" / "model.safetensors")) == {"b"}


async def test_the_key_picks_a_sub_tree_and_nested_levels_join_with_dots(tmp_path: Path) -> None:
    w, b = torch.randn(3, 2), torch.randn(3)
    state = {"policy": {"net": {"0": {"weight": w, "bias": b}}}, "value": {"w": torch.ones(1)}}
    async with asyncsave.Checkpointer(tmp_path / "run") as ckpt:
        info = await (await ckpt.save(1, state))
    asyncsave.export_hf(info.path, tmp_path / "hf", key="policy")
    weights = safetensors.torch.load_file(tmp_path / "hf" / "model.safetensors")
    assert set(weights) == {"net.0.weight", "net.0.bias"}
    assert torch.equal(weights["net.0.weight"], w) and torch.equal(weights["net.0.bias"], b)


async def test_a_state_of_only_tensors_exports_whole_by_default(tmp_path: Path) -> None:
    sd = {"a.weight": torch.randn(2, 2), "b.bias": torch.randn(2)}
    async with asyncsave.Checkpointer(tmp_path / "run") as ckpt:
        info = await (await ckpt.save(1, sd))
    asyncsave.export_hf(info.path, tmp_path / "hf")
    weights = safetensors.torch.load_file(tmp_path / "hf" / "model.safetensors")
    assert set(weights) == set(sd) and all(torch.equal(weights[k], v) for k, v in sd.items())


async def test_bad_requests_are_typed_errors_naming_the_key(tmp_path: Path) -> None:
    c = torch.randn(2).to(torch.complex128)
    state = {"policy": {"w": torch.randn(2)}, "bad": {"c": c}, "step": 4}
    async with asyncsave.Checkpointer(tmp_path / "run") as ckpt:
        info = await (await ckpt.save(1, state))
    with pytest.raises(asyncsave.MissingItemError, match="'model'") as no_default:
        asyncsave.export_hf(info.path, tmp_path / "a")
    assert no_default.value.key == "model"
    with pytest.raises(asyncsave.MissingItemError, match="'critic'"):
        asyncsave.export_hf(info.path, tmp_path / "b", key="critic")
    with pytest.raises(asyncsave.UnsupportedTensorError, match="complex128") as bad:
        asyncsave.export_hf(info.path, tmp_path / "c", key="bad")
    assert bad.value.key == "bad/c"
    with pytest.raises(ValueError, match="size"):
        asyncsave.export_hf(info.path, tmp_path / "d", key="policy", max_shard_bytes="5 parsecs")
    asyncsave.export_hf(info.path, tmp_path / "e", key="policy")
    with pytest.raises(FileExistsError, match=r"model\.safetensors"):
        asyncsave.export_hf(info.path, tmp_path / "e", key="policy")
    assert not [p for p in (tmp_path / "e").iterdir() if p.name.startswith(".")]


async def test_an_export_into_a_checkpoint_directory_or_a_url_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The checkpoint would be written to after its commit, and retention would
    # delete the export with it: into the step directory or below it, refused
    # before anything is created; into the root (no checkpoint), written. A URL
    # out_dir became a local directory "s3:".
    async with asyncsave.Checkpointer(tmp_path / "run") as ckpt:
        info = await (await ckpt.save(1, {"model": {"w": torch.randn(2)}}))
    before = sorted(p.name for p in info.path.iterdir())
    for out in (info.path, info.path / "hf", info.path / "a" / "b"):
        with pytest.raises(ValueError, match=r"in the checkpoint .*step_1"):
            asyncsave.export_hf(info.path, out)
    assert sorted(p.name for p in info.path.iterdir()) == before
    asyncsave.verify(info.path)
    # A URL is not made a local directory named "s3:".
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="URL"):
        asyncsave.export_hf(info.path, "s3://bucket/export")
    assert not (tmp_path / "s3:").exists()
    asyncsave.export_hf(info.path, tmp_path / "run" / "hf")
    assert (tmp_path / "run" / "hf" / "model.safetensors").is_file()


async def _save_ranks(root: Path, states: list[dict[str, object]]) -> Path:
    """One save of ``len(states)`` ranks (a FakeGroup in this process)."""
    group = FakeGroup(len(states))

    async def rank(r: int) -> None:
        async with asyncsave.Checkpointer(root, coordinator=group.rank(r)) as ckpt:
            await (await ckpt.save(1, states[r]))

    async with anyio.create_task_group() as tg:
        for r in range(len(states)):
            tg.start_soon(rank, r)
    return root / "step_1"


async def test_ranks_holding_different_parts_of_the_model_are_refused(tmp_path: Path) -> None:
    # Replicas (DDP) with per-rank optimizer shards (ZeRO-1): rank 0's model.
    w = torch.randn(4, 4)
    replicas = await _save_ranks(
        tmp_path / "ddp",
        [{"model": {"w": w.clone()}, "optim": {"m": torch.randn(2 + r)}} for r in range(2)],
    )
    asyncsave.export_hf(replicas, tmp_path / "ddp-hf")
    got = safetensors.torch.load_file(tmp_path / "ddp-hf" / "model.safetensors")
    assert set(got) == {"w"} and torch.equal(got["w"], w)
    # Pipeline stages (other keys) and tensor-parallel shards (other shapes):
    # rank 0's tensors would be a part of the model, exported without a word.
    stages = [{"model": {"layers.0.w": torch.randn(4)}}, {"model": {"layers.1.w": torch.randn(4)}}]
    shards = [{"model": {"w": torch.randn(2 + r, 4)}} for r in range(2)]
    for name, states in (("pp", stages), ("tp", shards)):
        path = await _save_ranks(tmp_path / name, states)
        with pytest.raises(asyncsave.UnsupportedFormatError, match="rank 1") as err:
            asyncsave.export_hf(path, tmp_path / f"{name}-hf")
        assert err.value.rank == 1
        assert err.value.key == {"pp": "model/layers.0.w", "tp": "model/w"}[name]
        assert not (tmp_path / f"{name}-hf").exists()


def _flip_a_byte_of(path: Path, key: str) -> None:
    """Damage one byte of the tensor ``key`` in its data file (under its checksum)."""
    doc = json.loads((path / "manifest.json").read_bytes())
    rec = next(t for t in doc["tensors"] if t["key"] == key)
    entry = doc["entries"][rec["entry"]]
    data = path / doc["files"][entry["file"]]["name"]
    raw = bytearray(data.read_bytes())
    raw[entry["offset"] + entry["nbytes"] // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


async def test_only_the_models_bytes_are_read_and_a_failed_export_leaves_nothing(
    tmp_path: Path,
) -> None:
    model = {f"layer{i}.weight": torch.randn(64, 64) for i in range(4)}  # 16 KiB each
    state = {"model": model, "optim": {"m": torch.randn(1000)}, "step": 1}
    async with asyncsave.Checkpointer(tmp_path / "run") as ckpt:
        info = await (await ckpt.save(1, state))
    _flip_a_byte_of(info.path, "optim/m")
    with pytest.raises(asyncsave.ChecksumMismatchError, match="optim/m"):
        asyncsave.load(info.path)
    # The export reads the model's entries only: the damaged optimizer is not read.
    asyncsave.export_hf(info.path, tmp_path / "ok", max_shard_bytes=20_000)
    assert len(list((tmp_path / "ok").glob("model-*.safetensors"))) == 4
    # A damaged weight in the last shard: the shards written before it are removed.
    _flip_a_byte_of(info.path, "model/layer3.weight")
    out = tmp_path / "bad"
    with pytest.raises(asyncsave.ChecksumMismatchError, match="layer3"):
        asyncsave.export_hf(info.path, out, max_shard_bytes=20_000, config={"a": 1})
    assert list(out.iterdir()) == []
    asyncsave.export_hf(info.path, out, key="optim", verify=False)  # the directory is usable


async def test_the_directories_an_export_creates_are_made_durable_in_their_parents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh out_dir whose entry in its parent was never fsynced can vanish at a
    # power loss with every file fsynced into it.
    path = await save_trained(tmp_path / "run", tiny_gpt2())
    synced: list[Path] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "exports" / "hf"
    asyncsave.export_hf(path, out)
    assert {tmp_path, tmp_path / "exports", out} <= set(synced)
    assert any(p.parent == out for p in synced)  # the weights file, as written


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
async def test_a_dcp_checkpoint_exports_its_full_tensors(tmp_path: Path) -> None:
    # The DCP route (the one DTensor state takes), here from one process.
    import torch.distributed.checkpoint as dcp

    from asyncsave.dcp import StorageWriter

    model = tiny_gpt2()
    writer = StorageWriter(tmp_path / "run", 5)
    dcp.save({"model": model.state_dict(), "step": 5}, storage_writer=writer, no_dist=True)
    info = asyncsave.latest(tmp_path / "run")
    assert info is not None
    path = info.path
    asyncsave.export_hf(path, tmp_path / "hf", config=model.config.to_dict())
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(logits(loaded), logits(model))


async def test_the_command_exports_with_a_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_gpt2()
    path = await save_trained(tmp_path / "run", model)
    model.config.save_pretrained(tmp_path / "cfg")
    out = io.StringIO()
    argv = ["export", "--format", "hf", str(path), str(tmp_path / "hf")]
    argv += ["--config", str(tmp_path / "cfg" / "config.json"), "--max-shard-size", "30KB"]
    assert cli(argv, out=out) == 0
    assert "model.safetensors.index.json" in out.getvalue() and "config.json" in out.getvalue()
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(logits(loaded), logits(model))
    capsys.readouterr()
    assert cli(["export", str(path), str(tmp_path / "x"), "--key", "nothing"]) == 1
    err = capsys.readouterr().err
    assert "'nothing'" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as usage:  # a size that is not one: usage, exit 2
        cli(["export", str(path), str(tmp_path / "y"), "--max-shard-size", "5 parsecs"])
    assert usage.value.code == 2 and "5 parsecs" in capsys.readouterr().err


async def test_the_command_answers_a_request_it_cannot_meet_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # OUT inside the checkpoint, OUT a URL, a --config file that is not an object:
    # one line and status 2 (a traceback before), nothing written.
    async with asyncsave.Checkpointer(tmp_path / "run") as ckpt:
        info = await (await ckpt.save(1, {"model": {"w": torch.randn(2)}}))
    (tmp_path / "list.json").write_text("[1, 2]")
    bad_config = [str(tmp_path / "hf"), "--config", str(tmp_path / "list.json")]
    for rest, said in (
        ([str(info.path / "hf")], "in the checkpoint"),
        (["s3://bucket/hf"], "URL"),
        (bad_config, "JSON object"),
    ):
        capsys.readouterr()
        assert cli(["export", str(info.path), *rest]) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists() and not (info.path / "hf").exists()


# -- saved on 2 gloo ranks (CPU) -----------------------------------------------------


def _save_on_two(rank: int, world: int, root: str) -> bytes | None:
    """Rank 0 and 1 save one tiny GPT-2: FSDP2-sharded (DTensor state, DCP's route)
    under ``root/fsdp``, and a plain per-rank state under ``root/plain`` (rank 0's
    weights are the model's; rank 1's are not). Rank 0 returns the full state dict
    (``torch.save`` bytes: a tensor would cross the pipe through shared memory)."""
    import io

    from torch.distributed.fsdp import fully_shard

    model = tiny_gpt2()
    plain = {
        k: v.clone() if rank == 0 else torch.zeros_like(v) for k, v in model.state_dict().items()
    }
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)  # wte and the tied lm_head stay in the root's group

    async def main() -> None:
        async with asyncsave.Checkpointer(f"{root}/fsdp", dist_timeout_s=60) as ckpt:
            await (await ckpt.save(7, {"model": model, "step": 7}))
        async with asyncsave.Checkpointer(f"{root}/plain", dist_timeout_s=60) as ckpt:
            await (await ckpt.save(7, {"model": plain, "rank": rank}))

    anyio.run(main)
    full = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    if rank:
        return None
    buffer = io.BytesIO()
    torch.save(full, buffer)
    return buffer.getvalue()


@pytest.mark.slow
def test_checkpoints_saved_on_two_ranks_export_whole(tmp_path: Path) -> None:
    from distributed import run_ranks, values

    root = tmp_path / "run"
    packed, _ = values(run_ranks(_save_on_two, 2, tmp_path, str(root), timeout_s=300))
    full = torch.load(io.BytesIO(packed), weights_only=True)
    reference = tiny_gpt2()
    reference.load_state_dict(full)
    manifest = json.loads((root / "fsdp" / "step_7" / "manifest.json").read_bytes())
    assert manifest["world_size"] == 2 and manifest["tree"]["type"] == "dcp"
    for kind in ("fsdp", "plain"):
        out = tmp_path / f"hf-{kind}"
        asyncsave.export_hf(root / kind / "step_7", out, config=reference.config)
        loaded = GPT2LMHeadModel.from_pretrained(out).eval()
        assert torch.equal(logits(loaded), logits(reference)), kind
        weights = safetensors.torch.load_file(out / "model.safetensors")
        assert set(weights) == set(full), kind
