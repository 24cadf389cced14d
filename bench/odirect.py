"""Does O_DIRECT help here? Buffered writes + one fsync against O_DIRECT writes of
the same bytes from the same page-aligned buffer, on the same file system.

usage: python bench/odirect.py [--mib 1024] [--repeats 3] [--dir /tmp] [--out FILE]

The figure decides whether asyncsave's writer gets an O_DIRECT path
(docs/decisions.md, "O_DIRECT is not used").
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import time
from pathlib import Path


def write(path: Path, buf: mmap.mmap, nbytes: int, chunk: int, direct: bool) -> float:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    view = memoryview(buf)
    t0 = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        done = 0
        while done < nbytes:
            n = min(chunk, nbytes - done)
            os.write(fd, view[:n])
            done += n
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk-mib", type=int, default=8)
    p.add_argument("--dir", type=Path, default=Path("/tmp"))
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    nbytes, chunk = args.mib << 20, args.chunk_mib << 20
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(chunk))
    path = args.dir / "asyncsave-odirect.bin"
    times: dict[str, list[float]] = {"buffered": [], "o_direct": []}
    try:
        for _ in range(args.repeats):
            for mode in times:
                times[mode].append(write(path, buf, nbytes, chunk, mode == "o_direct"))
                path.unlink()
    finally:
        path.unlink(missing_ok=True)
    result = {
        "bytes": nbytes,
        "chunk_bytes": chunk,
        "repeats": args.repeats,
        **{f"{m}_s": statistics.median(t) for m, t in times.items()},
        **{f"{m}_gbps": nbytes / statistics.median(t) / 1e9 for m, t in times.items()},
        "samples": times,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
