"""A set-up dataloader in ``fabric.save``'s state, as LitGPT keeps one (``state["train_dataloader"]``): saved as
its ``state_dict()`` (the epoch of the next pass, and the wrapped loader's own state when it has one), so the
file stays loadable with ``weights_only=True``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import phalanx as L


class CountingLoader(DataLoader):  # type: ignore[type-arg]
    """A loader with state of its own (as torchdata's StatefulDataLoader or litdata's StreamingDataLoader)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.consumed = 0

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed = state["consumed"]


def test_a_set_up_loader_is_saved_as_its_state_and_restored(tmp_path: Path) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = fabric.setup(torch.nn.Linear(2, 2))
    plain = fabric.setup_dataloaders(DataLoader(torch.arange(8.0), batch_size=2, shuffle=True))
    counting = fabric.setup_dataloaders(CountingLoader(torch.arange(8.0), batch_size=2))
    for _ in plain:  # one whole pass
        pass
    next(iter(plain))  # a second pass, left unfinished: it counts as not run
    counting.loader.consumed = 3
    fabric.save(tmp_path / "ckpt", {"model": model, "loader": plain, "counting": counting, "iter_num": 5})
    raw = torch.load(tmp_path / "ckpt", weights_only=True)  # plain values only
    assert raw["loader"] == {"epoch": 1} and raw["counting"] == {"epoch": 0, "loader": {"consumed": 3}}

    fresh = fabric.setup_dataloaders(DataLoader(torch.arange(8.0), batch_size=2, shuffle=True))
    fresh_counting = fabric.setup_dataloaders(CountingLoader(torch.arange(8.0), batch_size=2))
    state: dict[str, Any] = {"model": model, "loader": fresh, "counting": fresh_counting, "iter_num": 0}
    fabric.load(tmp_path / "ckpt", state)
    assert state["iter_num"] == 5 and fresh.state_dict() == {"epoch": 1}
    assert fresh_counting.loader.consumed == 3
