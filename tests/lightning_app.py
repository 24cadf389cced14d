"""A tiny Lightning run on CPU for the asyncsave.lightning tests, importable and
runnable as a script (the crash test SIGKILLs it during a save).

``python lightning_app.py ROOT EPOCHS [--kill-at STEP] [--resume CKPT_PATH] OUT``
fits, then writes the final weights and optimizer state to ``OUT`` (torch.save,
a test artefact, not a checkpoint).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from asyncsave.lightning import AsyncsaveCheckpointIO

BATCHES_PER_EPOCH = 4


class Tiny(LightningModule):
    def __init__(self, lr: float = 0.05, extra: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8 * BATCHES_PER_EPOCH, 4, generator=g)
        y = x.sum(1, keepdim=True)
        return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


def trainer(root: Path, epochs: int, plugin: AsyncsaveCheckpointIO, **ckpt_kw: Any) -> Trainer:
    kw: dict[str, Any] = {"monitor": "step", "mode": "max", "save_top_k": 2, "save_last": True}
    kw.update(ckpt_kw)
    return Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[plugin],
        callbacks=[ModelCheckpoint(dirpath=root, **kw)],
    )


def fit(
    root: Path,
    epochs: int,
    *,
    plugin: AsyncsaveCheckpointIO | None = None,
    ckpt_path: Any = None,
    model: Tiny | None = None,
    **ckpt_kw: Any,
) -> Tiny:
    torch.manual_seed(0)  # not seed_everything: it sets environment variables
    model = model or Tiny()
    t = trainer(root, epochs, plugin or AsyncsaveCheckpointIO(), **ckpt_kw)
    t.fit(model, ckpt_path=ckpt_path)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("epochs", type=int)
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    options: dict[str, Any] = {}
    if args.kill_at is not None:
        sys.path.insert(0, str(Path(__file__).parent))
        from faults import FaultyFS, kill

        # The second write into the temporary file of the step's .ckpt: the
        # file is half written when the process dies.
        tag = f"step={args.kill_at}.ckpt-"
        options["filesystem"] = FaultyFS(
            "write", kill(), n=2, where=lambda p: ".asyncsave-tmp-" in p and tag in p
        )
    model = fit(
        args.root, args.epochs, plugin=AsyncsaveCheckpointIO(**options), ckpt_path=args.resume
    )
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)


if __name__ == "__main__":
    main()
