"""Random number generator state of every library a trainer draws from, as one
``Stateful`` item of the state tree.

Resuming bit-exactly needs the RNG streams where the interrupted run left them
(dropout masks, data shuffling, sampling in RL rollouts), not just the weights.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from ._errors import InvalidStateError

__all__ = ["RNGState"]

logger = logging.getLogger("asyncsave")


class RNGState:
    """The global RNG states of Python's ``random``, NumPy's legacy global
    generator, torch on the CPU and torch on every CUDA device, captured when the
    state is saved and restored in place on load::

        state = {"model": model, "rng": asyncsave.RNGState()}
        await ckpt.save(step, state)
        ...
        await ckpt.load_latest(state)   # RNG streams continue where they were

    Extra generators (a ``torch.Generator`` of a sampler, a
    ``numpy.random.Generator``) can be passed by name and are captured too.

    CUDA states are restored to the devices that exist; a checkpoint saved with a
    different number of CUDA devices restores the common ones and logs a warning
    (bit-exact resume needs the same devices).

    :param generators: name → ``torch.Generator`` or ``numpy.random.Generator``.
    """

    def __init__(self, **generators: torch.Generator | np.random.Generator) -> None:
        for name, g in generators.items():
            if not isinstance(g, (torch.Generator, np.random.Generator)):
                raise TypeError(
                    f"RNGState({name}=...) must be a torch.Generator or "
                    f"numpy.random.Generator, got {type(g).__name__}"
                )
        self.generators = generators

    def state_dict(self) -> dict[str, Any]:
        """Copies of the current states: ``python`` (tuple), ``numpy`` (the legacy
        state tuple, uint32 key array of shape (624,)), ``torch`` (uint8 CPU
        tensor), ``cuda`` (a list of uint8 CPU tensors, one per device; empty
        without CUDA) and ``generators`` (by name)."""
        version, internal, gauss = random.getstate()
        np_state: Any = np.random.get_state(legacy=True)
        cuda: list[torch.Tensor] = []
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = list(torch.cuda.get_rng_state_all())
        gens: dict[str, Any] = {}
        for name, g in self.generators.items():
            if isinstance(g, torch.Generator):
                gens[name] = {"kind": "torch", "state": g.get_state()}
            else:
                gens[name] = {"kind": "numpy", "state": g.bit_generator.state}
        return {
            "python": {"version": version, "internal": list(internal), "gauss": gauss},
            "numpy": {
                "kind": np_state[0],
                "keys": np_state[1].copy(),
                "pos": int(np_state[2]),
                "has_gauss": int(np_state[3]),
                "cached_gaussian": float(np_state[4]),
            },
            "torch": torch.get_rng_state(),
            "cuda": cuda,
            "generators": gens,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the states captured by :meth:`state_dict`.

        :raises InvalidStateError: a part is missing or malformed (named), or a
            named generator is missing on either side.
        """
        try:
            py = state["python"]
            random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
            npst = state["numpy"]
            np.random.set_state(
                (
                    npst["kind"],
                    np.asarray(npst["keys"], dtype=np.uint32),
                    npst["pos"],
                    npst["has_gauss"],
                    npst["cached_gaussian"],
                )
            )
            torch.set_rng_state(state["torch"])
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise InvalidStateError(f"RNGState: cannot restore ({exc!r})", key="rng") from exc
        cuda = list(state.get("cuda", []))
        if cuda:
            present = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if present != len(cuda):
                logger.warning(
                    "RNGState saved %d CUDA device states, %d devices here: restoring %d",
                    len(cuda),
                    present,
                    min(present, len(cuda)),
                )
            for i, s in enumerate(cuda[:present]):
                torch.cuda.set_rng_state(s, i)
        saved = state.get("generators", {})
        if set(saved) != set(self.generators):
            raise InvalidStateError(
                f"RNGState: saved generators {sorted(saved)} but this one has "
                f"{sorted(self.generators)}",
                key="rng",
            )
        for name, g in self.generators.items():
            if isinstance(g, torch.Generator):
                g.set_state(saved[name]["state"])
            else:
                g.bit_generator.state = saved[name]["state"]
