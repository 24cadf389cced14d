"""The memory tier: what it costs the trainer per save, how fast a
restarted trainer is restored from it, and what that buys per failure.

One run measures (medians of ``--repeats``; the 1-minute load average is
recorded after each part):

1. **Blocking per save**: the time ``await ckpt.save(step, state)`` takes, the
   second and later saves, for the same state in the same loop through

   - ``plain``: ``Checkpointer(root)`` (the snapshot staged in the trainer, the
     write behind it in the trainer's threads);
   - ``local tier``: ``Checkpointer(local, persistent=Tier(root))`` with
     ``local`` in ``--shm`` (node-local RAM disk), persisted every save;
   - ``memory tier``: ``Checkpointer(root, memory=MemoryTier(shm_dir=--shm))``
     (persisted every save: ``persist=None``).

   The three are open side by side and take turns, one save each per round
   (the order rotating). After each save the loop lets the background work
   finish, as a trainer's compute would: ``await handle`` (committed: on disk
   for ``plain``, in memory for the tiers) and, for the tiers, ``await
   handle.persisted()`` when ``handle.due_to_persist``, then sleeps
   ``--compute-s`` (a step's compute: the trackers and retention that run after
   ``persisted()`` land there, not in the next checkpointer's ``save()``); so
   every save is measured in steady state. Each
   of those waits is timed from the ``save()`` call too (``committed``,
   ``persisted``). Two states: ``gpt``, a GPT-like model (bf16 weights, no
   biases, plus fp32 AdamW ``exp_avg`` / ``exp_avg_sq``), and ``small``,
   ``--small-count`` float32 tensors of ``--small-numel`` elements.

2. **Restart to restored** (the ``gpt`` state): a child process of this script
   (``--child-save``) saves a step through the memory tier and is SIGKILLed
   once ``save()`` returned; its saver commits the step to memory, persists it
   to ``root`` and exits. Then, in this process,

   - ``memory``: ``async with Checkpointer(root, memory=MemoryTier(...))`` and
     ``load_latest(template)`` (read from memory: checked), timed from entering
     the checkpointer (the saver process's start included) and the
     ``load_latest`` call alone; the clean close removes the tier, so every
     repeat starts with a new child;
   - ``disk, asyncsave.load``: ``asyncsave.load(root/step_N, template)`` of the
     same checkpoint, its files' pages dropped (``posix_fadvise DONTNEED``);
   - ``disk, Checkpointer``: ``async with Checkpointer(root)`` +
     ``load_latest(template)``, pages dropped (the whole restart from disk);
   - ``local tier``: ``async with Checkpointer(local, persistent=Tier(root))`` +
     ``load_latest(template)`` of the local tier part 1 left (tmpfs: there is no
     cache to drop);
   - ``copy floor``: one ``torch._foreach_copy_`` of the template's bytes into
     other tensors (warm): what any load into a template costs at least.

3. **Training lost per failure** (a model, printed with its assumptions in the
   results file): from the numbers of 1 and 2, for failures every ``--mtbf-min``
   minutes and steps of ``--step-s`` seconds.

usage: python bench/memory_tier.py [--repeats 9] [--restart-repeats 7] [--compute-s 0.3]
       [--d-model 768] [--layers 4] [--vocab 8192] [--ctx 1024]
       [--small-count 2000] [--small-numel 1024] [--persist-every 100]
       [--mtbf-min 30,120] [--step-s 1,10] [--dir DIR] [--shm /dev/shm]
       [--out bench/results/memory_tier.md]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import drop_cache

import asyncsave
from asyncsave import MemoryTier, Tier

RESULTS = Path(__file__).resolve().parent / "results"


# -- states ---------------------------------------------------------------------
def gpt_state(d: int, layers: int, vocab: int, ctx: int, seed: int = 0) -> dict[str, Any]:
    """A GPT-like training state: bf16 weights (no biases) and the fp32 AdamW
    moments of every weight, plus the step."""
    shapes: dict[str, tuple[int, ...]] = {"wte": (vocab, d), "wpe": (ctx, d)}
    for i in range(layers):
        shapes |= {
            f"h.{i}.ln_1": (d,),
            f"h.{i}.attn.qkv": (3 * d, d),
            f"h.{i}.attn.proj": (d, d),
            f"h.{i}.ln_2": (d,),
            f"h.{i}.mlp.fc": (4 * d, d),
            f"h.{i}.mlp.proj": (d, 4 * d),
        }
    shapes["ln_f"] = (d,)
    g = torch.Generator().manual_seed(seed)
    model = {k: torch.randn(s, generator=g).mul_(0.02).bfloat16() for k, s in shapes.items()}
    avg = {k: torch.randn(s, generator=g).mul_(1e-3) for k, s in shapes.items()}
    sq = {k: torch.rand(s, generator=g).mul_(1e-6) for k, s in shapes.items()}
    return {"model": model, "optim": {"exp_avg": avg, "exp_avg_sq": sq}, "step": 0}


def small_state(count: int, numel: int, seed: int = 0) -> dict[str, Any]:
    """``count`` float32 tensors of ``numel`` elements, plus the step."""
    g = torch.Generator().manual_seed(seed)
    return {"params": {f"p{i}": torch.randn(numel, generator=g) for i in range(count)}, "step": 0}


def tensors_of(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors_of(v)]
    return []


def nbytes_of(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def template_of(state: Any) -> Any:
    """A tree of the same shape to load into (zeros; the step a plain 0)."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: template_of(v) for k, v in state.items()}
    return state


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _load() -> float:
    return os.getloadavg()[0]


# -- 1. blocking per save ---------------------------------------------------------------
async def one_save(
    ckpt: Any, step: int, state: dict[str, Any]
) -> tuple[float, float, float | None]:
    """One save of ``state``, let finish (committed, and persisted when due) as a
    trainer's compute would: (``save()`` returned, committed, persisted or
    ``None`` when not due), each from the call."""
    state["step"] = step
    t0 = time.perf_counter()
    handle = await ckpt.save(step, state)
    t1 = time.perf_counter()
    await handle
    t2 = time.perf_counter()
    if not getattr(handle, "due_to_persist", False):
        return t1 - t0, t2 - t0, None
    await handle.persisted()
    return t1 - t0, t2 - t0, time.perf_counter() - t0


async def bench_saves(
    state: dict[str, Any],
    work: Path,
    shm: Path,
    local: Path,
    repeats: int,
    *,
    keep: bool = False,
    compute_s: float = 0.0,
) -> dict[str, dict[str, float]]:
    """Part 1 for one state: ``repeats + 1`` rounds, each one save through each of
    the three checkpointers (open side by side; the order rotates every round, so
    that the machine's other load falls on all three alike); medians over all but
    the first round of ``blocked_s`` (``save()``), ``committed_s`` (``await
    handle``) and ``persisted_s`` (``await handle.persisted()``, when due), all
    from the call. The disk roots go under ``work``, the local tier in ``local``,
    the memory tier in ``shm``. With ``keep`` the local tier and its persistent
    root are left for the restarts of part 2. After each save the loop sleeps
    ``compute_s``, a training step's compute: what a checkpointer does after
    ``persisted()`` (its trackers, retention) then runs there, as in training,
    instead of inside the next checkpointer's ``save()``."""
    last2 = asyncsave.KeepLast(2)
    samples: dict[str, dict[str, list[float]]] = {}
    tier = Tier(work / "local-root", retention=last2)
    memory = MemoryTier(shm_dir=str(shm))
    async with (
        asyncsave.Checkpointer(work / "plain", retention=last2) as plain,
        asyncsave.Checkpointer(local, retention=last2, persistent=tier) as two,
        asyncsave.Checkpointer(work / "memory", memory=memory, retention=last2) as mem,
    ):
        ckpts = [("plain", plain), ("local tier", two), ("memory tier", mem)]
        for step in range(1, repeats + 2):
            turn = step % len(ckpts)
            for name, ckpt in ckpts[turn:] + ckpts[:turn]:
                blocked, committed, persisted = await one_save(ckpt, step, state)
                await anyio.sleep(compute_s)
                if step == 1:
                    continue
                got = samples.setdefault(name, {"blocked": [], "committed": [], "persisted": []})
                got["blocked"].append(blocked)
                got["committed"].append(committed)
                if persisted is not None:
                    got["persisted"].append(persisted)
    shutil.rmtree(work / "plain", ignore_errors=True)
    shutil.rmtree(work / "memory", ignore_errors=True)
    if not keep:  # else the restarts of part 2 resume from them
        shutil.rmtree(local, ignore_errors=True)
        shutil.rmtree(work / "local-root", ignore_errors=True)
    return {
        name: {
            "blocked_s": _med(got["blocked"]),
            "blocked_min_s": min(got["blocked"]),
            "blocked_max_s": max(got["blocked"]),
            "committed_s": _med(got["committed"]),
            "persisted_s": _med(got["persisted"]),
        }
        for name, got in ((n, samples[n]) for n, _ in ckpts)
    }


# -- 2. restart to restored --------------------------------------------------------------
def _gone(pid: int, timeout_s: float = 300.0) -> None:
    """Wait until ``pid`` exited (a zombie counts)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    raise RuntimeError(f"the saver {pid} did not exit within {timeout_s} s")


def killed_after_save(
    args: argparse.Namespace, root: Path, shm: Path, step: int, out: Path
) -> None:
    """A child trainer saves ``step`` through the memory tier and is SIGKILLed
    once ``save()`` returned; wait until its saver committed, persisted, exited."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, __file__, "--child-save", str(root), str(shm), str(step), str(out),
        "--d-model", str(args.d_model), "--layers", str(args.layers),
        "--vocab", str(args.vocab), "--ctx", str(args.ctx),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd)
    returned = out / "returned"
    try:
        deadline = time.monotonic() + 600
        while not returned.exists():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the child trainer exited ({proc.returncode}) before its save returned"
                )
            if time.monotonic() > deadline:
                raise RuntimeError("the child trainer's save did not return within 600 s")
            time.sleep(0.02)
    finally:
        proc.kill()
        proc.wait(60)
    _gone(json.loads(returned.read_text())["saver_pid"])


async def _child_save(root: str, shm: str, step: int, out: Path, args: argparse.Namespace) -> None:
    state = gpt_state(args.d_model, args.layers, args.vocab, args.ctx, seed=step)
    state["step"] = step
    async with asyncsave.Checkpointer(root, memory=MemoryTier(shm_dir=shm)) as ckpt:
        await ckpt.save(step, state)
        (out / "returned.tmp").write_text(json.dumps({"saver_pid": ckpt.saver_pid}))
        os.replace(out / "returned.tmp", out / "returned")  # the parent never reads half of it
        await anyio.sleep(600)  # the parent SIGKILLs this process


async def restart_memory(root: Path, shm: Path, template: Any, step: int) -> dict[str, float]:
    t0 = time.perf_counter()
    async with asyncsave.Checkpointer(root, memory=MemoryTier(shm_dir=str(shm))) as ckpt:
        t1 = time.perf_counter()
        restored = await ckpt.load_latest(template)
        t2 = time.perf_counter()
        if restored is None or ckpt.memory_root is None:
            raise RuntimeError("nothing to resume from in the memory tier")
        where = Path(restored.info.path)
        if restored.info.step != step or not where.is_relative_to(ckpt.memory_root):
            raise RuntimeError(
                f"resumed step {restored.info.step} from {where}, not {step} from memory"
            )
    return {
        "memory_whole_s": t2 - t0,
        "memory_load_s": t2 - t1,
        "memory_close_s": time.perf_counter() - t2,
    }


async def restart_checkpointer(root: Path, template: Any, step: int, **kw: Any) -> dict[str, float]:
    t0 = time.perf_counter()
    async with asyncsave.Checkpointer(root, **kw) as ckpt:
        t1 = time.perf_counter()
        restored = await ckpt.load_latest(template)
        t2 = time.perf_counter()
        if restored is None or restored.info.step != step:
            raise RuntimeError(f"resumed {restored and restored.info.step}, not {step}")
        if Path(restored.info.path).parent.resolve() != Path(root).resolve():
            raise RuntimeError(f"resumed from {restored.info.path}, not from {root}")
    return {"whole_s": t2 - t0, "load_s": t2 - t1}


def bench_restarts(
    args: argparse.Namespace, template: Any, work: Path, shm: Path, local: Path, local_step: int
) -> dict[str, float]:
    """Part 2: medians of ``--restart-repeats`` restarts of each kind."""
    root = work / "restart"
    samples: dict[str, list[float]] = {}

    def add(d: dict[str, float], prefix: str = "") -> None:
        for k, v in d.items():
            samples.setdefault(prefix + k, []).append(v)

    dst = [torch.empty_like(t) for t in tensors_of(template)]
    torch._foreach_copy_(dst, tensors_of(template))  # touched: the floor is warm
    for r in range(args.restart_repeats):
        step = 100 + r
        killed_after_save(args, root, shm, step, work / f"child{r}")
        add(anyio.run(restart_memory, root, shm, template, step))
        t0 = time.perf_counter()  # the floor of any load into a template
        torch._foreach_copy_(dst, tensors_of(template))
        add({"copy_floor_s": time.perf_counter() - t0})
        ck = root / f"step_{step}"
        drop_cache(ck)
        t0 = time.perf_counter()
        asyncsave.load(ck, template)
        add({"disk_load_s": time.perf_counter() - t0})
        drop_cache(ck)
        add(anyio.run(restart_checkpointer, root, template, step), "disk_ckpt_")
        tier = Tier(work / "gpt" / "local-root", retention=asyncsave.KeepLast(2))
        kw = {"persistent": tier, "retention": asyncsave.KeepLast(2)}
        add(
            anyio.run(functools.partial(restart_checkpointer, local, template, local_step, **kw)),
            "local_",
        )
    del dst
    left = [p for p in shm.iterdir() if p != local]
    if left:
        raise RuntimeError(f"the memory tier left {left} in {shm}")
    return {k: _med(v) for k, v in samples.items()}


# -- 3. training lost per failure --------------------------------------------------------
def model(
    m: dict[str, float], mtbf_s: float, step_s: float, persist_every: int
) -> list[dict[str, Any]]:
    """Expected training seconds lost per failure that the node survives, per
    strategy (see :data:`ASSUMPTIONS`). ``m`` holds the measured times:
    ``B_plain, D_plain, B_local, D_local, B_mem, C_mem, R_disk, R_local, R_mem``."""

    def lost(every: int, blocked: float, safe_after: float, restart: float) -> dict[str, float]:
        interval = every * step_s
        recompute = interval / 2 + safe_after
        blocking = mtbf_s / interval * blocked
        return {
            "save_every_steps": every,
            "recompute_s": recompute,
            "restart_s": restart,
            "blocking_s": blocking,
            "total_s": recompute + restart + blocking,
        }

    def keeps_up(t: float) -> int:  # the fewest steps between saves that do not queue
        return max(1, math.ceil(t / step_s))

    def best(low: int, blocked: float) -> int:
        """The ``k >= low`` that minimises ``k*s/2 + T*B/(k*s)`` (Young's interval
        ``sqrt(2*T*B)``, in whole steps)."""
        x = math.sqrt(2 * mtbf_s * blocked) / step_s
        candidates = {low, max(low, math.floor(x)), max(low, math.ceil(x))}
        return min(candidates, key=lambda k: k * step_s / 2 + mtbf_s * blocked / (k * step_s))

    plain = (m["B_plain"], m["D_plain"], m["R_disk"])
    local = (m["B_local"], m["D_local"], m["R_local"])
    mem = (m["B_mem"], m["B_mem"], m["R_mem"])
    rows = [
        (f"persistent only, every {persist_every} steps", max(persist_every, keeps_up(m["D_plain"])), plain),
        ("persistent only, best interval", best(keeps_up(m["D_plain"]), m["B_plain"]), plain),
        (f"local tier (tmpfs), best interval, persist every {persist_every}",
         best(keeps_up(m["D_local"]), m["B_local"]), local),
        (f"memory tier, every step, persist every {persist_every}", keeps_up(m["C_mem"]), mem),
        (f"memory tier, best interval, persist every {persist_every}",
         best(keeps_up(m["C_mem"]), m["B_mem"]), mem),
    ]  # fmt: skip
    return [{"strategy": name, **lost(k, *times)} for name, k, times in rows]


ASSUMPTIONS = """\
The model (every time in seconds; B, D, C, R measured above, `gpt` state):

- Training runs steps of `s` s; a failure the node survives (the trainer process
  dies: a crash, an OOM kill, a hung collective killed by the launcher, a job
  preemption that keeps the node) strikes every `T` s on average, at a uniformly
  random instant between two saves.
- A strategy saves every `k` steps (interval `I = k*s`). A save is safe `S` s after
  its `save()` call: without a memory tier once committed (`S = D`, `await
  handle`: on disk for the plain checkpointer, in the tmpfs tier for the local
  tier; a save in flight dies with the trainer); with the memory tier as soon as
  `save()` returned (`S = B`: the saver holds the snapshot and commits it even
  if the trainer dies). A failure `u` s after a save loses `u` if `u >= S`, else
  `u + I`: on average `I/2 + S` of recomputed training.
- The restart costs `R`, from entering the checkpointer to restored (cold page
  cache for the disk; the memory tier's saver process starts after the resume,
  while training goes on: its start, about 2 s here, delays only a first save
  made within it). The job's own
  restart (scheduler, interpreter, imports, building the model) is the same for
  every strategy and left out.
- Each save blocks training `B` s: `T/I * B` per failure.
- Lost per failure = `I/2 + S` + `R` + `T/I * B`.
- `k`: fixed where the row says so (every 100 steps: the usual practice when a
  save blocks for a whole synchronous write; every step: the memory tier's
  pitch); "best interval": the whole number of steps nearest Young's interval
  `sqrt(2*T*B)`, which minimises `I/2 + T/I * B`. Never fewer steps than
  `D/s` (`C/s` for the memory tier, `C` its commit to memory), so saves never
  queue behind each other. The background work (writes, the saver) is assumed
  not to slow the training step (a GPU trainer; on this 2-core CPU machine it
  would).
- Failures that lose the node resume from the root with every strategy (the
  tiers persist every 100 saves): about `100*s/2 + D + R_disk` lost for the
  tiers, fewer for "persistent only, best interval"; not in the table.
"""


# -- output -----------------------------------------------------------------------------
def markdown(result: dict[str, Any]) -> str:
    ms = lambda v: f"{v * 1e3:.1f}"  # noqa: E731
    lines = [
        "# Memory tier benchmark",
        "",
        f"`{result['command']}`",
        "",
        f"{result['date']}; {result['machine']}; 1-minute load average at the start "
        f"{result['load_start']:.2f}, after part 1 {result['load_after_saves']:.2f}, after "
        f"part 2 {result['load_after_restarts']:.2f}.",
        "",
        "## 1. Trainer blocking per save",
        "",
        f"Medians of {result['repeats']} rounds (the 2nd and later) of the same state in the "
        "same loop, one save through each checkpointer per round (open side by side, the "
        "order rotating each round); after each save the loop awaits the handle (committed) and, for the tiers, "
        "`handle.persisted()` (every save is persisted: the default policy), then sleeps "
        f"{result['compute_s']:g} s, a training step's compute (what runs after `persisted()`, "
        "trackers and retention, runs there and not inside the next checkpointer's `save()`). "
        "Times in ms from the `save()` call; `blocked` is what the trainer waits for.",
        "",
        "| state | MiB | tensors | checkpointer | blocked | (min..max) | committed | persisted | blocked / plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, st in result["saves"].items():
        plain = st["rows"]["plain"]["blocked_s"]
        for row, v in st["rows"].items():
            lines.append(
                f"| {name} | {st['mib']:.0f} | {st['tensors']:,} | {row} | {ms(v['blocked_s'])} | "
                f"{ms(v['blocked_min_s'])}..{ms(v['blocked_max_s'])} | {ms(v['committed_s'])} | "
                + (ms(v["persisted_s"]) if not math.isnan(v["persisted_s"]) else "-")
                + f" | {v['blocked_s'] / plain:.2f} |"
            )
    lines += [
        "",
        "| target | state | value | met |",
        "|---|---|---|---|",
    ]
    for name, st in result["saves"].items():
        ratio = st["rows"]["memory tier"]["blocked_s"] / st["rows"]["plain"]["blocked_s"]
        lines.append(
            f"| memory / plain blocking <= 1.1 | {name} | {ratio:.2f} | {'yes' if ratio <= 1.1 else 'NO'} |"
        )
    r = result["restarts"]
    lines += [
        "",
        "## 2. Restart to restored",
        "",
        f"The `gpt` state ({result['saves']['gpt']['mib']:.0f} MiB), medians of "
        f"{result['restart_repeats']}. Memory: a child trainer saved the step through the "
        "memory tier and was SIGKILLed once `save()` returned; its saver committed and "
        "persisted the step and exited; the restart read it from memory (checked). Disk: the "
        "same checkpoint in `root` on the local disk, its pages dropped before each load. "
        "Local tier: the tmpfs tier part 1 left. Times in ms.",
        "",
        "| restore from | whole restart (enter + load_latest) | load alone |",
        "|---|---|---|",
        f"| memory tier (its saver starts after the resume) | {ms(r['memory_whole_s'])} | {ms(r['memory_load_s'])} |",
        f"| disk, `Checkpointer(root)` + `load_latest` (cold) | {ms(r['disk_ckpt_whole_s'])} | {ms(r['disk_ckpt_load_s'])} |",
        f"| disk, `asyncsave.load(root/step_N, template)` (cold) | - | {ms(r['disk_load_s'])} |",
        f"| local tier (tmpfs), `Checkpointer(local, persistent=Tier(root))` | {ms(r['local_whole_s'])} | {ms(r['local_load_s'])} |",
        f"| floor: one `torch._foreach_copy_` of the state into the template (warm) | - | {ms(r.get('copy_floor_s', float('nan')))} |",
        "",
        f"Entering the memory tier's checkpointer took {ms(r['memory_whole_s'] - r['memory_load_s'])} ms "
        "of the memory tier's whole restart: no saver of the root was alive, so the trainer "
        "resumed by itself (every byte verified) and its saver process (a new interpreter "
        "importing torch) started once the resume was done. The restart was timed after the "
        "dead trainer's saver had exited (a restart that comes sooner waits for it).",
        "",
        f"The memory tier's clean close after the restore (the saver's start, then flush, "
        f"remove the tier, stop the saver): {ms(r['memory_close_s'])} ms.",
        "",
        "| target | value | met |",
        "|---|---|---|",
    ]
    for label, num, den in [
        (
            "memory load alone <= 0.2 x `asyncsave.load` from disk",
            r["memory_load_s"],
            r["disk_load_s"],
        ),
        (
            "memory whole restart <= 0.2 x `asyncsave.load` from disk",
            r["memory_whole_s"],
            r["disk_load_s"],
        ),
        (
            "memory whole restart <= 0.2 x disk whole restart",
            r["memory_whole_s"],
            r["disk_ckpt_whole_s"],
        ),
    ]:
        lines.append(f"| {label} | {num / den:.2f} | {'yes' if num <= 0.2 * den else 'NO'} |")
    m = result["model_inputs"]
    lines += [
        "",
        "## 3. Training lost per failure (a model)",
        "",
        ASSUMPTIONS,
        "Inputs (s): " + ", ".join(f"{k} = {v:.3f}" for k, v in m.items()) + ".",
        "",
        "| failure every | step | strategy | save every (steps) | recompute | restart | blocking | total lost per failure |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for sc in result["model"]:
        for row in sc["rows"]:
            lines.append(
                f"| {sc['mtbf_min']:g} min | {sc['step_s']:g} s | {row['strategy']} | "
                f"{row['save_every_steps']} | {row['recompute_s']:.1f} s | {row['restart_s']:.1f} s | "
                f"{row['blocking_s']:.1f} s | {row['total_s']:.1f} s |"
            )
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> dict[str, Any]:
    load_start = _load()
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    shm = Path(tempfile.mkdtemp(prefix="asyncsave-bench-memtier-", dir=args.shm or base))
    work = Path(tempfile.mkdtemp(prefix="asyncsave-bench-memtier-", dir=args.dir))
    try:
        saves: dict[str, Any] = {}
        gpt = gpt_state(args.d_model, args.layers, args.vocab, args.ctx)
        local = shm / "local-gpt"
        for name, state in (
            ("gpt", gpt),
            ("small", small_state(args.small_count, args.small_numel)),
        ):
            rows = anyio.run(
                functools.partial(
                    bench_saves,
                    state,
                    work / name,
                    shm,
                    shm / f"local-{name}",
                    args.repeats,
                    keep=name == "gpt",
                    compute_s=args.compute_s,
                )
            )
            saves[name] = {
                "mib": nbytes_of(state) / (1 << 20),
                "tensors": len(tensors_of(state)),
                "rows": rows,
            }
            print(name, json.dumps(rows), flush=True)
        load_after_saves = _load()
        template = template_of(gpt)
        del gpt
        local_step = args.repeats + 1
        restarts = bench_restarts(args, template, work, shm, local, local_step)
        print("restarts", json.dumps(restarts), flush=True)
        load_after_restarts = _load()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    g = saves["gpt"]["rows"]
    inputs = {
        "B_plain": g["plain"]["blocked_s"],
        "D_plain": g["plain"]["committed_s"],
        "B_local": g["local tier"]["blocked_s"],
        "D_local": g["local tier"]["committed_s"],
        "B_mem": g["memory tier"]["blocked_s"],
        "C_mem": g["memory tier"]["committed_s"],
        "R_disk": restarts["disk_ckpt_whole_s"],
        "R_local": restarts["local_whole_s"],
        "R_mem": restarts["memory_whole_s"],
    }
    scenarios = [
        {"mtbf_min": t, "step_s": s, "rows": model(inputs, t * 60, s, args.persist_every)}
        for t in (float(x) for x in args.mtbf_min.split(","))
        for s in (float(x) for x in args.step_s.split(","))
    ]
    result = {
        "command": "python " + " ".join([os.path.relpath(__file__), *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} CPUs, {psutil.virtual_memory().total / (1 << 30):.0f} GiB, "
        f"torch {torch.__version__}, Python {sys.version.split()[0]}, disk root in "
        f"{args.dir or tempfile.gettempdir()}, tmpfs {args.shm or base}",
        "load_start": load_start,
        "load_after_saves": load_after_saves,
        "load_after_restarts": load_after_restarts,
        "repeats": args.repeats,
        "compute_s": args.compute_s,
        "restart_repeats": args.restart_repeats,
        "saves": saves,
        "restarts": restarts,
        "model_inputs": inputs,
        "model": scenarios,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(result))
    print(markdown(result))
    return result


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--restart-repeats", type=int, default=7)
    ap.add_argument(
        "--compute-s", type=float, default=0.3, help="a training step's compute after each save (s)"
    )
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--small-count", type=int, default=2000)
    ap.add_argument("--small-numel", type=int, default=1024)
    ap.add_argument("--persist-every", type=int, default=100)
    ap.add_argument("--mtbf-min", default="30,120")
    ap.add_argument("--step-s", default="1,10")
    ap.add_argument("--dir", default=None, help="where the disk roots go (default: the temp dir)")
    ap.add_argument("--shm", default=None, help="tmpfs for the tiers (default: /dev/shm)")
    ap.add_argument("--out", default=str(RESULTS / "memory_tier.md"))
    ap.add_argument(
        "--child-save", nargs=4, metavar=("ROOT", "SHM", "STEP", "OUT"), help=argparse.SUPPRESS
    )
    return ap


if __name__ == "__main__":
    a = parser().parse_args()
    if a.child_save:
        root_, shm_, step_, out_ = a.child_save
        anyio.run(_child_save, root_, shm_, int(step_), Path(out_), a)
    else:
        main(a)
