"""Data-file format: safetensors, laid out so every tensor is naturally aligned.

A data file is a plain safetensors file (8-byte little-endian header length, JSON
header, packed data) that ``safetensors.safe_open`` opens and mmaps. The library's
own writer (``safetensors.torch.save_file``) is not used because it serialises
through an extra in-memory copy and cannot fsync or checksum on the way; the format
itself is followed exactly (no holes between tensors: safetensors rejects them).

Alignment without holes: the header is padded with spaces so data starts at a
multiple of 4096 bytes (which O_DIRECT writes need), and entries are ordered by element size, largest first. Every
entry's size is a multiple of its element size, so every entry starts at a multiple
of its own element size, which is what typed views (and mmap loads) need.

Every dtype safetensors names is stored as that dtype, so ``safetensors.torch.load_file``
returns it (see :func:`header_dtype`). Dtypes safetensors has no name for (complex128,
complex32, the sub-byte and bits types) and the blobs of storages shared by tensors
of different extents are stored as ``U8`` byte arrays; the manifest records the real
dtype and stays the source of truth.
"""

from __future__ import annotations

import dataclasses
import json
import struct

import torch

from ._paths import data_file_name
from ._plan import Entry

__all__ = [
    "ALL_SAFETENSORS_DTYPES",
    "FileLayout",
    "NEWER_SAFETENSORS_DTYPES",
    "SAFETENSORS_BITS",
    "SAFETENSORS_DTYPES",
    "header_dtype",
    "layout_buckets",
    "layout_files",
]

HEADER_ALIGN = 64
# Data start in every file and every file's data in the staging buffer are aligned
# to this, so the bulk of a file can be written with O_DIRECT (whose offsets,
# addresses and lengths must be multiples of the device's logical block size).
DIRECT_ALIGN = 4096
# Below this, one more file costs more (open, fsync) than a parallel writer gains.
MIN_FILE_BYTES = 64 << 20

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
}
# Names safetensors added later (0.5: MX scales and FP4). A reader of manifest
# format 1 or 2 refuses a header naming them, so a save that writes one says
# manifest format 3 (``_manifest.NAMED_DTYPES_VERSION``): such a reader then
# asks to be upgraded instead of calling the file damaged.
NEWER_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    dtype: name
    for dtype, name in (
        (getattr(torch, "float8_e8m0fnu", None), "F8_E8M0"),
        (getattr(torch, "float4_e2m1fn_x2", None), "F4"),
    )
    if dtype is not None
}
ALL_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {**SAFETENSORS_DTYPES, **NEWER_SAFETENSORS_DTYPES}
# Bits per element of each safetensors dtype name this writes or reads.
SAFETENSORS_BITS: dict[str, int] = {
    name: (4 if name == "F4" else 8 * dtype.itemsize)
    for dtype, name in ALL_SAFETENSORS_DTYPES.items()
}


def header_dtype(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[str, list[int]] | None:
    """The safetensors dtype name and header shape of a tensor of ``dtype`` and
    ``shape``, or ``None`` when safetensors cannot name it (stored as ``U8``).

    ``float4_e2m1fn_x2`` holds two 4-bit values per element; safetensors' ``F4``
    counts the 4-bit values, so its header shape doubles the last dimension (as
    ``safetensors.torch.save_file`` writes it); a 0-d one has no such shape and
    is stored as ``U8``.
    """
    name = ALL_SAFETENSORS_DTYPES.get(dtype)
    if name is None:
        return None
    if name == "F4":
        return (name, [*shape[:-1], 2 * shape[-1]]) if shape else None
    return name, list(shape)


@dataclasses.dataclass
class FileLayout:
    """One data file of a save: its name, header bytes and entries in file order."""

    index: int
    name: str
    header: bytes  # length prefix + padded JSON header
    data_nbytes: int
    entries: list[int]  # indices into Plan.entries, in file order
    staging_offset: int  # where this file's data starts in the staging buffer

    @property
    def nbytes(self) -> int:
        return len(self.header) + self.data_nbytes


def layout_files(entries: list[Entry], *, rank: int, max_files: int) -> list[FileLayout]:
    """Spread ``entries`` over at most ``max_files`` files of balanced size and fix
    every entry's ``file``, ``offset`` and ``staging_offset``.

    Pure: no I/O. The staging buffer holds the files' data back to back, each
    starting at a multiple of 4096 bytes.
    """
    total = sum(e.nbytes for e in entries)
    n_files = max(1, min(max_files, len(entries), -(-total // MIN_FILE_BYTES)))
    buckets: list[list[int]] = [[] for _ in range(n_files)]
    sizes = [0] * n_files
    for i in sorted(range(len(entries)), key=lambda i: -entries[i].nbytes):
        target = sizes.index(min(sizes))
        buckets[target].append(i)
        sizes[target] += entries[i].nbytes
    return layout_buckets(entries, [b for b in buckets if b] or [[]], rank=rank)


def layout_buckets(
    entries: list[Entry], buckets: list[list[int]], *, rank: int
) -> list[FileLayout]:
    """Lay out one data file per bucket (indices into ``entries``), in bucket order,
    and fix every entry's ``file``, ``offset`` and ``staging_offset``. Pure."""
    layouts: list[FileLayout] = []
    staging = 0
    for f, bucket in enumerate(buckets):
        # Largest element size first keeps every entry naturally aligned; the
        # plan's order breaks ties so the layout is deterministic.
        order = sorted(bucket, key=lambda i: (-entries[i].align, i))
        meta = {"format": "pt", "writer": "asyncsave"}
        header_obj: dict[str, object] = {"__metadata__": meta}
        rel = 0
        for i in order:
            e = entries[i]
            for alias in e.aliases:  # tied weights: as safetensors.torch.save_model
                meta.setdefault(alias, e.name)
            # A blob of a shared region is a uint8 entry of shape (nbytes,).
            named = header_dtype(e.dtype, e.shape)
            st_dtype, shape = named if named is not None else ("U8", [e.nbytes])
            header_obj[e.name] = {
                "dtype": st_dtype,
                "shape": shape,
                "data_offsets": [rel, rel + e.nbytes],
            }
            e.file = f
            e.offset = rel  # made absolute below, once the header length is known
            e.staging_offset = staging + rel
            rel += e.nbytes
        header = json.dumps(header_obj, separators=(",", ":")).encode("utf-8")
        pad = -(8 + len(header)) % DIRECT_ALIGN
        header += b" " * pad
        prefix = struct.pack("<Q", len(header))
        for i in order:
            entries[i].offset += len(prefix) + len(header)
        layouts.append(
            FileLayout(
                index=f,
                name=data_file_name(rank, f),
                header=prefix + header,
                data_nbytes=rel,
                entries=order,
                staging_offset=staging,
            )
        )
        staging += -(-rel // DIRECT_ALIGN) * DIRECT_ALIGN
    return layouts


def staging_nbytes(layouts: list[FileLayout]) -> int:
    """Bytes of staging buffer the files need (each file's data 4096-aligned)."""
    return sum(-(-fl.data_nbytes // DIRECT_ALIGN) * DIRECT_ALIGN for fl in layouts)
