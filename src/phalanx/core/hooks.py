"""The Module's optional hooks (Lightning's ``ModelHooks``), with their defaults.

Kept apart from :mod:`phalanx.core.module` because they are a list, not machinery: each is called by
the Trainer at a fixed point of its loops (docs/trainer.md has the order) and most do nothing by
default. The Trainer skips calling a default that does nothing (:func:`phalanx.core.module.no_op_hooks`
reads which from the bytecode), so a body given to one of these defaults is picked up automatically.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx.utils.tensors import move_to_device


class ModelHooks(nn.Module):
    """Mixed into :class:`phalanx.Module`: every hook the Trainer calls on the module, with its default."""

    def configure_callbacks(self) -> Any:
        """Callbacks this module needs; they are added to the Trainer's (replacing ones of the same type)."""
        return []

    def configure_model(self) -> None:
        """Create layers here to build them directly on the device / sharded (called before setup)."""

    def setup(self, stage: str) -> None:
        """Called on every rank at the start of fit/validate/test/predict, before the model is set up."""

    def teardown(self, stage: str) -> None:
        """Called at the end of fit/validate/test/predict."""

    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_test_start(self) -> None: ...
    def on_test_end(self) -> None: ...
    def on_predict_start(self) -> None: ...
    def on_predict_end(self) -> None: ...

    def on_train_epoch_start(self) -> None: ...

    def on_train_epoch_end(self) -> None:
        """May call ``self.log``; those values count as epoch-level."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any: ...
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_validation_epoch_start(self) -> None: ...

    def on_validation_epoch_end(self) -> None:
        """May call ``self.log``; those values count as epoch-level."""

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_epoch_start(self) -> None: ...
    def on_predict_epoch_end(self) -> None: ...
    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...

    def on_validation_model_eval(self) -> None:
        self.eval()

    def on_validation_model_train(self) -> None:
        self.train()

    def on_test_model_eval(self) -> None:
        self.eval()

    def on_test_model_train(self) -> None:
        self.train()

    def on_predict_model_eval(self) -> None:
        self.eval()

    def on_before_backward(self, loss: torch.Tensor) -> None: ...
    def on_after_backward(self) -> None: ...
    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Once per real optimizer step, after the last micro-batch's backward, before clipping."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add entries to ``checkpoint`` (plain picklable values)."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read the entries ``on_save_checkpoint`` added."""


class DataHooks:
    """Lightning's ``DataHooks``, shared by :class:`phalanx.Module` and :class:`phalanx.DataModule`: how a
    batch reaches the device. The Trainer refuses overrides of these (the Fabric moves batches itself), so
    the defaults say what is done; they exist so that Lightning code that calls or overrides them imports."""

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return move_to_device(batch, device)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch
