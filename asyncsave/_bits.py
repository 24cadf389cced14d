"""A tensor's bytes, moved as bits, never as values.

A checkpoint round-trips every dtype bit for bit. A same-dtype ``copy_`` or
``clone()`` does not always: a ``bool`` tensor whose bytes are not 0/1 (made by
``.view(torch.bool)`` of ``uint8`` data) comes out with every non-zero byte
normalised to 1. Every copy and every byte view that staging, streaming, hashing
and the DCP writer make of a source tensor goes through these functions.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["as_bits", "clone_bits", "flat_bytes", "host_bytes"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t`` as integers of the same width (complex: as its real and
    imaginary parts, one more dimension of 2), same shape and strides otherwise,
    so a copy between two such views moves bits, never converts values. A view
    ignores a conjugate or negative bit: resolve those first (:func:`flat_bytes`
    and :func:`clone_bits` do)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_INT_OF_SIZE[t.element_size()])


def clone_bits(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (same dtype, shape and device; strides as ``empty_like``)
    whose bytes are ``t``'s bit for bit, where ``t.clone()`` may normalise them
    (``bool``). On CUDA it is queued on the current stream, as ``clone()``."""
    out = torch.empty_like(t)
    as_bits(out).copy_(as_bits(_resolved(t)))
    return out


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes in row-major order as a 1-D ``uint8`` tensor of
    ``t.numel() * t.element_size()`` bytes on ``t``'s device.

    A contiguous ``t`` gives a view of its storage (no copy), whatever the strides
    of its dimensions of size 1 (``torch.arange(2.)[::2]``, one element of stride
    2, is contiguous, yet ``.view(torch.uint8)`` refuses it); any other ``t`` (or
    one whose conjugate or negative bit is set) gives a copy, made bit for bit.
    """
    size = t.element_size()
    if t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
            t.untyped_storage(), t.storage_offset() * size, (t.numel() * size,), (1,)
        )
    return as_bits(_resolved(t)).contiguous().reshape(-1).view(torch.uint8)


def host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` (a 1-D contiguous ``uint8`` CPU tensor, such as
    :func:`flat_bytes` gives) as a memoryview over its memory, for hashing in
    place. Not through ``t.numpy()``: that marks the storage non-resizable for
    good, and a caller's ``resize_()`` of a tensor a save only read would then
    fail (and leave it with a shape its storage does not hold). The view does
    not keep ``t`` alive: hold ``t`` while it is used.

    :raises ValueError: ``t`` is not a contiguous 1-D ``uint8`` CPU tensor.
    """
    if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"host_bytes needs a contiguous 1-D uint8 CPU tensor, not {t!r:.80}")
    n = t.numel()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a conjugate or negative view bit applied (a copy), else ``t``."""
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t
