"""The fp8 training loop shared by tests/precision/test_fp8.py (one process, the reference) and the jobs it starts
(tests/support/jobs/fp8_training.py): every rank trains on its slice of the same global batches, so N ranks and one
process see the same data per step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from llama_models import LlamaConfig, flat_params, lm_loss, make_llama, markov_tokens, split
from torch import nn

from phalanx import Fabric, Module
from phalanx.checkpoint import latest
from phalanx.precision import Float8Precision, Precision

CFG = LlamaConfig()
GLOBAL_BATCH = 8
STEPS, SAVE_AT = 8, 4  # the Fabric loop: a checkpoint after SAVE_AT steps, reloaded to redo the rest


def precision(name: str) -> str | Precision:
    """The precision a test names: fp8 runs emulated (this is a CPU)."""
    return Float8Precision(emulate=True) if name == "fp8-mixed" else name


def data(steps: int = STEPS) -> torch.Tensor:
    return markov_tokens(CFG, steps, GLOBAL_BATCH)


def rank_slice(block: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = block.shape[0] // world
    return block[rank * per : (rank + 1) * per]


def optimizer(module: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum: parameter updates scale with the gradients (Adam's would not), so N ranks and one process
    can be compared by their updates; the momentum is optimizer state a resume must bring back."""
    return torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9)


def train_fabric(fabric: Fabric, folder: Path) -> dict[str, Any]:
    """STEPS steps, with a checkpoint and a snapshot after SAVE_AT; then each is loaded into the same objects and the
    last steps run again. Returns this rank's losses per step (its slice), the redone steps' losses and parameters
    after each reload, the final parameters and which layers run in float8."""
    model = make_llama(CFG)
    model, opt = fabric.setup(model, optimizer(model))
    tokens = data()
    rank, world = fabric.global_rank, fabric.world_size
    state = {"model": model, "optimizer": opt}

    def step(i: int) -> float:
        x, y = split(rank_slice(tokens[i], rank, world))
        loss = lm_loss(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.item()

    losses = []
    for i in range(STEPS):
        losses.append(step(i))
        if i + 1 == SAVE_AT:
            fabric.save(folder / "step.ckpt", state)
            fabric.save_snapshot({**state, "step": i + 1}, i + 1, folder / "snapshots", every_n_steps=1)
    out: dict[str, Any] = {"losses": losses, "params": flat_params(model).tolist(),
                           "converted": list(getattr(fabric.strategy.precision, "converted", []))}
    for source in ("checkpoint", "snapshot"):
        path = folder / "step.ckpt" if source == "checkpoint" else latest([folder / "snapshots"])
        assert path is not None
        fabric.load(path, state)
        out[f"{source}_losses"] = [step(i) for i in range(SAVE_AT, STEPS)]
        out[f"{source}_params"] = flat_params(model).tolist()
    return out


class LlamaModule(Module):
    """The Trainer's view of the same model and data (its own batches, in order: no shuffling)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = make_llama(CFG)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = split(batch)
        loss = lm_loss(self.model(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        return optimizer(self)


def loader(world: int, steps: int) -> Any:
    """Per rank, GLOBAL_BATCH // world rows per step, ``steps`` steps (the Trainer splits by rank itself)."""
    rows: Any = list(data(steps).flatten(0, 1))  # a list of samples is a map-style dataset
    return torch.utils.data.DataLoader(rows, batch_size=GLOBAL_BATCH // world, shuffle=False)


def module_params(module: nn.Module) -> list[float]:
    return flat_params(module).tolist()
