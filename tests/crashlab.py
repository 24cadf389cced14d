"""Crash laboratory: SIGKILL a saver at every file-system call, and at random
instants, then check what a fresh process finds. Run as a script by
``tests/test_crash_matrix.py`` (one interpreter imports torch once and ``os.fork``s
a child per case), or by hand::

    python tests/crashlab.py matrix  [--backends asyncio,trio] [--scenarios a,b]
    python tests/crashlab.py random  --runs 500 [--seed S]

Each prints one JSON document on stdout (the cases run, their kill points, and any
failure with what is needed to replay it).

The oracle, after every kill (checked in a freshly forked process, which has never
opened a checkpointer):

1. every directory under a final name verifies (every checksum) and holds exactly
   the state of one save that was dispatched for its step, never a mix;
2. if a tracker exists it names such a directory (the tracker never lies);
3. ``asyncsave.latest`` resolves to a step at least as new as the newest save whose
   ``await handle`` returned before the kill, and it loads bit-exactly;
4. a new :class:`~asyncsave.Checkpointer` opens, ``load_latest()`` returns the same
   step bit-exactly, no temporary directory is left, and the tracker names the
   newest committed step.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import random
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import torch
import trio  # noqa: F401  (imported once here, not in every forked child)

sys.path.insert(0, str(Path(__file__).parent))
from fstrace import TracingFS

import asyncsave
from asyncsave.testing import checkpoint_step, is_temp_name, thresholds, tracker_file_name


@contextlib.contextmanager
def small_own_files() -> Iterator[None]:
    """Incremental saves give a tensor of 1 MiB (``own_file_bytes``) or more a data file of
    its own: lowered, while the lab's scenarios run (in its forked children, or
    around an in-process recording), so that this small state has one file per
    tensor, some shared, some not. Never at import: other test files in the same
    process rely on the library's value."""
    with thresholds(own_file_bytes=64):
        yield


# Every child is forked from this process: what the children use is imported here,
# once, not again in each of the ~1,700 children (asyncsave's public names and
# anyio's backends load lazily; importing them cost a child about 0.1 s, more than
# its scenario). The modules are named only to load them early (their members are
# not used here).
for _module in (
    "asyncsave._engine",
    "asyncsave._resume",
    "asyncsave._tiers",
    "asyncsave._update",
    "anyio._backends._asyncio",
    "anyio._backends._trio",
    "anyio.from_thread",
    "anyio.to_thread",
):
    importlib.import_module(_module)
for _name in ("Checkpointer", "latest", "load", "verify"):
    getattr(asyncsave, _name)

TRACKER = tracker_file_name("asyncsave")
assert TRACKER is not None
MAX_WRITE = 1024  # short writes: a crash may fall in the middle of a data file


def state_of(step: int, ver: int = 0) -> dict[str, Any]:
    """The state saved as version ``ver`` of ``step``: small, several dtypes,
    about 2.4 KiB of tensor bytes (so a data file takes three short writes). Two
    tensors for incremental saves: ``frozen`` is the same at every step, and
    ``replay`` only grows (its first rows never change)."""
    g = torch.Generator().manual_seed(step * 1000 + ver % 1000)  # ver + 1000k: same tensors
    return {
        "model": {
            "w": torch.randn(24, 16, generator=g),
            "b": torch.randn(16, generator=g).half(),
            "i": torch.randint(0, 1 << 30, (8,), generator=g),
            "frozen": torch.arange(32, dtype=torch.float32),
            "replay": torch.arange(step * 32, dtype=torch.int32).view(-1, 4),
        },
        "optim": {"m": torch.randn(8, 8, generator=g, dtype=torch.float64)},
        "trainer": {"step": step, "ver": ver},
    }


def same_state(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(b, dict):
        return (
            isinstance(a, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in b)
        )
    return type(a) is type(b) and a == b


# -- the event log a child keeps outside the root (survives SIGKILL) -------------


class EventLog:
    """Append-only ``D step ver`` (dispatched) / ``A step ver`` (acknowledged)
    lines, written with unbuffered ``write(2)`` so a SIGKILL loses nothing logged."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def add(self, kind: str, step: int, ver: int) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{kind} {step} {ver}\n".encode())
        finally:
            os.close(fd)

    def read(self) -> list[tuple[str, int, int]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            k, s, v = line.split()
            out.append((k, int(s), int(v)))
        return out


def allowed_versions(
    events: list[tuple[str, int, int]], base: dict[int, int]
) -> dict[int, list[int]]:
    """For each step, the versions its directory may hold: every version dispatched
    (or in the base tree), from the last acknowledged one on."""
    dispatched: dict[int, list[int]] = {s: [v] for s, v in base.items()}
    acked: dict[int, int] = {}
    for kind, s, v in events:
        if kind == "D":
            dispatched.setdefault(s, []).append(v)
        elif kind == "A":
            acked[s] = v
    for s, v in acked.items():
        vs = dispatched[s]
        dispatched[s] = vs[vs.index(v) :]
    return dispatched


def newest_ack(events: list[tuple[str, int, int]], base: dict[int, int]) -> int | None:
    steps = [s for k, s, _ in events if k == "A"] + list(base)
    return max(steps, default=None)


def final_dirs(root: Path) -> dict[int, Path]:
    out = {}
    for p in root.iterdir():
        step = checkpoint_step("asyncsave", p.name)
        if step is not None and p.is_dir():
            out[step] = p
    return out


class OracleError(AssertionError):
    pass


def check(cond: bool, what: str) -> None:
    if not cond:
        raise OracleError(what)


def check_root(
    root: Path,
    events: list[tuple[str, int, int]],
    base: dict[int, int],
    options: dict[str, Any],
    backend: str,
    foreign: tuple[str, ...] = (),
) -> int | None:
    """The oracle (module docstring); returns the step resumed from. ``foreign``:
    final-named directories no save made (the recovery scenario plants one), which
    are exempt from check 1 until a checkpointer opens and moves them aside."""
    allowed = allowed_versions(events, base)
    acked = newest_ack(events, base)
    if not root.exists():
        check(acked is None, f"root gone but step {acked} was acknowledged")
        return None
    # 1. every final-named directory is whole, and one dispatched save of its step
    for step, path in sorted(final_dirs(root).items()):
        if path.name in foreign:
            continue
        try:
            asyncsave.verify(path)
        except asyncsave.CheckpointError as exc:
            raise OracleError(f"{path.name} under a final name fails verify: {exc!r}") from exc
        got = asyncsave.load(path)
        vers = allowed.get(step, [])
        check(
            any(same_state(got, state_of(step, v)) for v in vers),
            f"{path.name} holds none of the dispatched versions {vers} (trainer={got.get('trainer')})",
        )
    # 2. the tracker never lies
    tracker = root / TRACKER
    if tracker.exists():
        raw = tracker.read_bytes()
        check(raw.strip().isdigit(), f"tracker holds {raw!r}")
        t = int(raw)
        check(t in final_dirs(root), f"tracker names step {t}, which is not committed")
    # 3. the reader resolves to something at least as new as the last acknowledgement
    info = asyncsave.latest(root)
    committed = [s for s, p in final_dirs(root).items() if p.name not in foreign]
    if committed:  # the rename is the commit: resume takes the newest one
        check(
            info is not None and info.step == max(committed),
            f"latest {info} is not the newest commit {max(committed)}",
        )
    if acked is not None:
        check(info is not None and info.step >= acked, f"latest {info} older than acked {acked}")
    if info is not None:
        got = asyncsave.load(info.path)
        check(
            any(same_state(got, state_of(info.step, v)) for v in allowed.get(info.step, [])),
            f"latest step {info.step} does not load bit-exactly",
        )
    # 4. a new checkpointer resumes the same step, cleans up, rolls the tracker forward
    resumed: list[int | None] = [None]

    async def reopen() -> None:
        async with asyncsave.Checkpointer(root, **options) as ckpt:
            restored = await ckpt.load_latest()
            step = None if restored is None else restored.info.step
            check(
                step == (None if info is None else info.step),
                f"load_latest resumed {step}, latest() said {info and info.step}",
            )
            if restored is not None:
                check(
                    any(
                        same_state(restored.state, state_of(restored.info.step, v))
                        for v in allowed.get(restored.info.step, [])
                    ),
                    "load_latest is not bit-exact",
                )
            temps = [p.name for p in root.iterdir() if is_temp_name(p.name)]
            check(not temps, f"temporary entries left after open: {temps}")
            finals = final_dirs(root)
            if finals:
                check(
                    int((root / TRACKER).read_text()) == max(finals),
                    "tracker is not the newest committed step after open",
                )
            resumed[0] = step

    anyio.run(reopen, backend=backend)
    return resumed[0]


# -- scenarios of the matrix -------------------------------------------------------


@dataclass
class Scenario:
    """A deterministic save sequence: ``base`` steps are committed (version 0)
    before the child starts; ``body`` runs in the child, killed at some call."""

    name: str
    base: list[int]
    body: Callable[[asyncsave.Checkpointer, EventLog], Awaitable[None]]
    options: dict[str, Any] = field(default_factory=dict)
    prepare: Callable[[Path], None] | None = None
    foreign: tuple[str, ...] = ()  # final-named dirs planted by ``prepare``, not by a save


async def _save(
    ckpt: asyncsave.Checkpointer, log: EventLog, step: int, ver: int = 1, **kw: Any
) -> Any:
    log.add("D", step, ver)
    return await ckpt.save(step, state_of(step, ver), **kw)


async def _ack(handle: Any, log: EventLog, step: int, ver: int = 1) -> None:
    await handle
    log.add("A", step, ver)


async def first_save(ckpt: asyncsave.Checkpointer, log: EventLog) -> None:
    await _ack(await _save(ckpt, log, 1), log, 1)


async def steady_state(ckpt: asyncsave.Checkpointer, log: EventLog) -> None:
    for step in (3, 4):
        await _ack(await _save(ckpt, log, step), log, step)


async def two_in_flight(ckpt: asyncsave.Checkpointer, log: EventLog) -> None:
    h3 = await _save(ckpt, log, 3)
    h4 = await _save(ckpt, log, 4)
    await _ack(h3, log, 3)
    await _ack(h4, log, 4)


async def retention(ckpt: asyncsave.Checkpointer, log: EventLog) -> None:
    await _ack(await _save(ckpt, log, 3), log, 3)


async def overwrite(ckpt: asyncsave.Checkpointer, log: EventLog) -> None:
    await _ack(await _save(ckpt, log, 2, ver=1, overwrite=True), log, 2, 1)


async def incremental(ckpt: asyncsave.Checkpointer, log: EventLog) -> None:
    """Two incremental saves. Step 3 links ``frozen`` and the old row chunks of
    ``replay`` from step 2 (after reading them back: a fresh process) at write
    time, writes the rest, and retention deletes that base; step 4 writes
    ``replay``'s new chunk (a file never seen) in the background while it hashes
    the files step 3 wrote or linked and links the unchanged ones while staging
    (into its early temporary directory). One writer thread each for the hashing
    and the early write: the calls are the same in every run, their order across
    the two threads may vary."""
    await _ack(await _save(ckpt, log, 3), log, 3)
    await _ack(await _save(ckpt, log, 4), log, 4)


async def update_item(ckpt: asyncsave.Checkpointer, log: EventLog) -> None:
    """Save step 3, then rewrite its ``trainer`` item in place (hard links to the
    data files, a new manifest, an exchange): version 1001 is version 1 with a new
    trainer item."""
    await _ack(await _save(ckpt, log, 3), log, 3)
    log.add("D", 3, 1001)
    await ckpt.update(3, "trainer", {"step": 3, "ver": 1001})
    log.add("A", 3, 1001)


def leftovers(root: Path) -> None:
    """What an earlier crash leaves: a half-written temp dir, a tracker temp file,
    a commit the tracker missed (step 2), a manifest-less final directory."""
    (root / ".asyncsave-tmp-9-0123456789ab").mkdir()
    (root / ".asyncsave-tmp-9-0123456789ab" / "data-r00000-000.safetensors").write_bytes(b"x" * 100)
    (root / f".asyncsave-tmp-{TRACKER}-0123456789ab").write_text("9")
    (root / TRACKER).write_text("1")
    (root / "step_7").mkdir()
    (root / "step_7" / "data-r00000-000.safetensors").write_bytes(b"y" * 10)


async def recovery_then_save(ckpt: asyncsave.Checkpointer, log: EventLog) -> None:
    await _ack(await _save(ckpt, log, 3), log, 3)


# One line per state; the retention state is the one-liner the integrator's KeepLast
# made possible. Every call of each body is a kill point (enumerated, not listed).
SCENARIOS = {
    s.name: s
    for s in [
        Scenario("first_save", [], first_save),
        Scenario("steady_state", [1, 2], steady_state),
        Scenario("two_in_flight", [1, 2], two_in_flight),
        Scenario("retention", [1, 2], retention, {"retention": asyncsave.KeepLast(1)}),
        Scenario("overwrite", [1, 2], overwrite),
        Scenario("update_item", [1, 2], update_item),
        Scenario(
            "incremental",
            [1, 2],
            incremental,
            {"incremental": True, "retention": asyncsave.KeepLast(1), "writer_threads": 1},
        ),
        Scenario(
            "recovery_then_save",
            [1, 2],
            recovery_then_save,
            prepare=leftovers,
            foreign=("step_7",),
        ),
    ]
}


def make_base(
    root: Path,
    steps: list[int],
    prepare: Callable[[Path], None] | None,
    options: dict[str, Any] | None = None,
) -> None:
    async def go() -> None:
        async with asyncsave.Checkpointer(root, **(options or {})) as ckpt:
            for s in steps:
                await (await ckpt.save(s, state_of(s, 0)))

    root.mkdir(parents=True, exist_ok=True)
    if steps:
        anyio.run(go)
    if prepare is not None:
        prepare(root)
    lock = root / ".asyncsave.lock"
    if lock.exists():
        lock.unlink()


# -- forking -------------------------------------------------------------------


def in_child(fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0) -> tuple[int, str]:
    """Run ``fn`` in a forked child; returns its exit code (negative: the signal
    that ended it; 124: it hung past ``timeout_s`` and was killed) and what it
    reported (a traceback when it raised, then its code is 17)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        code = 0
        try:
            with small_own_files():
                fn(*args)
        except BaseException:
            os.write(w, traceback.format_exc().encode()[-4000:])
            code = 17
        os._exit(code)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + timeout_s
    hung = False
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            hung = True
            os.kill(pid, signal.SIGKILL)
            break
        ready, _, _ = select.select([r], [], [], remaining)
        if ready:
            data = os.read(r, 65536)
            if not data:
                break
            chunks.append(data)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if hung:
        return 124, "timed out (hung child)"
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode(errors="replace")


def run_body(
    root: Path,
    scen: Scenario,
    backend: str,
    log: EventLog,
    kill_at: int | None,
    side: Path,
) -> int:
    """In the child: open a checkpointer through the tracing shim and run the body;
    SIGKILL just before call ``kill_at``. Writes the call count (or the call killed)
    to ``side``."""

    def before(index: int, op: str, path: str) -> None:
        if index == kill_at:
            fd = os.open(side, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, json.dumps({"index": index, "op": op, "path": path}).encode())
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)

    fs = TracingFS(root, before=before, max_write=MAX_WRITE, record=False)

    async def go() -> None:
        async with asyncsave.Checkpointer(root, filesystem=fs, **scen.options) as ckpt:
            await scen.body(ckpt, log)

    anyio.run(go, backend=backend)
    side.write_text(json.dumps({"calls": fs.calls, "log": fs.log}))
    return 0


def matrix(backends: list[str], names: list[str], work: Path) -> dict[str, Any]:
    cases: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    for name in names:
        scen = SCENARIOS[name]
        template = work / f"base-{name}"
        code, err = in_child(make_base, template, scen.base, scen.prepare, scen.options)
        if code != 0:
            raise RuntimeError(f"base of {name} failed: {err}")
        base = dict.fromkeys(scen.base, 0)
        for backend in backends:
            # 1. a clean run records how many calls the body makes
            root, side, logp = work / "root", work / "side.json", work / "events.txt"
            _fresh(template, root, logp)
            code, err = in_child(run_body, root, scen, backend, EventLog(logp), None, side)
            if code != 0:
                raise RuntimeError(f"clean run of {name}/{backend} failed: {err}")
            clean = json.loads(side.read_text())
            n = clean["calls"]
            # 2. kill before each call i; i = n + 1 is a kill after the last call
            for i in range(1, n + 2):
                _fresh(template, root, logp)
                side.unlink(missing_ok=True)
                code, err = in_child(run_body, root, scen, backend, EventLog(logp), i, side)
                killed = code == -signal.SIGKILL
                point = json.loads(side.read_text()) if killed and side.exists() else {}
                case = {
                    "scenario": name,
                    "backend": backend,
                    "kill_at": i,
                    "killed": killed,
                    "op": point.get("op"),
                    "path": point.get("path"),
                }
                if not killed and code != 0:
                    failures.append({**case, "error": f"child exit {code}: {err}"})
                events = EventLog(logp).read()
                code, err = in_child(
                    check_root, root, events, base, scen.options, backend, scen.foreign
                )
                if code != 0:
                    failures.append({**case, "error": err[-3000:], "events": events})
                cases.append(case)
    return {"cases": cases, "failures": failures}


def _fresh(template: Path, root: Path, logp: Path) -> None:
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(template, root)
    logp.unlink(missing_ok=True)


# -- randomized crash runs -------------------------------------------------------


def random_child(root: Path, logp: Path, seed: int, run: int, options: dict[str, Any]) -> int:
    """One life of a trainer: check what the last one left, resume, then save a
    random sequence (overlapping saves, an overwrite now and then) and die at a
    random call or a random instant (or live to the end)."""
    rng = random.Random(f"{seed}-{run}")
    log = EventLog(logp)
    backend = rng.choice(["asyncio", "trio"])
    resumed = check_root(root, log.read(), {}, options, backend)
    mode = rng.choice(["call", "call", "call", "timer", "timer", "none"])
    kill_at = rng.randint(1, 45) if mode == "call" else None

    def before(index: int, op: str, path: str) -> None:
        if index == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    fs = TracingFS(root, before=before, max_write=rng.choice([None, 512, MAX_WRITE]), record=False)
    if mode == "timer":
        delay = rng.uniform(0.0, 0.04)
        t = threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL))
        t.daemon = True
        t.start()

    async def go() -> None:
        async with asyncsave.Checkpointer(root, filesystem=fs, **options) as ckpt:
            restored = await ckpt.load_latest()
            step = resumed or 0
            assert (restored is None and resumed is None) or restored.info.step == resumed
            handles = []
            mine: list[int] = []
            for _ in range(rng.randint(1, 4)):
                ver = run * 100 + len(handles) + 1
                if mine and rng.random() < 0.15:
                    s, kw = mine[-1], {"overwrite": True}
                    for h in handles:  # overwrite only what this run committed
                        await h[0]
                        log.add("A", h[1], h[2])
                    handles = []
                else:
                    step += rng.randint(1, 3)
                    s, kw = step, {}
                log.add("D", s, ver)
                h = await ckpt.save(s, state_of(s, ver), **kw)
                mine.append(s)
                handles.append((h, s, ver))
                if rng.random() < 0.5:  # otherwise leave it in flight
                    for h in handles:
                        await h[0]
                        log.add("A", h[1], h[2])
                    handles = []
            for h in handles:
                await h[0]
                log.add("A", h[1], h[2])

    anyio.run(go, backend=backend)
    return 0


def randomized(runs: int, seed: int, work: Path, per_chain: int = 10) -> dict[str, Any]:
    failures: list[dict[str, Any]] = []
    kills = 0
    done = 0
    chain = 0
    while done < runs:
        rng = random.Random(f"{seed}-chain-{chain}")
        options: dict[str, Any] = {"writer_threads": rng.choice([1, 2])}
        if rng.random() < 0.5:
            options["retention"] = asyncsave.KeepLast(rng.randint(1, 3))
        if rng.random() < 0.3:
            options["incremental"] = True
        root, logp = work / f"chain-{chain}", work / f"chain-{chain}.log"
        for _ in range(min(per_chain, runs - done)):
            run = done
            code, err = in_child(random_child, root, logp, seed, run, options)
            done += 1
            if code == -signal.SIGKILL:
                kills += 1
            elif code != 0:
                failures.append(
                    {
                        "seed": seed,
                        "run": run,
                        "chain": chain,
                        "options": repr(options),
                        "error": err[-3000:],
                    }
                )
                break
        else:
            code, err = in_child(check_root, root, EventLog(logp).read(), {}, options, "asyncio")
            if code != 0:
                failures.append({"seed": seed, "chain": chain, "final": True, "error": err[-3000:]})
        chain += 1
    return {"runs": done, "killed": kills, "chains": chain, "seed": seed, "failures": failures}


def main() -> None:
    torch.set_num_threads(1)
    logging.getLogger("asyncsave").setLevel(logging.CRITICAL)  # expected warnings
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["matrix", "random"])
    ap.add_argument("--backends", default="asyncio,trio")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--runs", type=int, default=500)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="asyncsave-crashlab-") as tmp:
        work = Path(tmp)
        if args.mode == "matrix":
            out = matrix(args.backends.split(","), args.scenarios.split(","), work)
        else:
            seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
            out = randomized(args.runs, seed, work)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
