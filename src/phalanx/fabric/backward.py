"""``fabric.backward``: the loss goes to the strategy (scaling, gradient sync) between the checks that
make a bad step loud: anomaly detection (``detect_anomaly``) and the nan/inf loss watch.

A loss from modules none of which was set up (e.g. a meta-learning inner model) is backpropagated as
``loss.backward()`` in one process, where there is nothing to sync; on several processes it is refused,
since nothing would average those gradients across ranks.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from phalanx.fabric.anomaly import AnomalyDetector, LossWatch
from phalanx.utils.errors import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.fabric.wrappers import FabricModule
    from phalanx.strategies import Strategy


class Backward:
    """The backward pass of one Fabric, with its optional checks (``anomaly``, ``loss_watch``)."""

    def __init__(self, strategy: Strategy, anomaly: AnomalyDetector | None, loss_watch: LossWatch | None) -> None:
        self._strategy, self._anomaly, self.loss_watch = strategy, anomaly, loss_watch

    def run(self, tensor: torch.Tensor, targets: list[FabricModule], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> None:
        """Backpropagate ``tensor`` through the set-up ``targets`` (every one's gradients synced)."""
        anomaly = self._anomaly
        if anomaly is not None:
            anomaly.before_backward(tensor)
        self._strategy.backward(tensor, [m.forward_module for m in targets], *args, **kwargs)
        if anomaly is not None:
            anomaly.after_backward([m.module for m in targets])
        watch = self.loss_watch
        if watch is not None:
            watch.record(tensor)

    def flush(self) -> None:
        """Report what the loss watch has not read yet; a failed device must not hide the error that ended
        the run, so its error is dropped."""
        if self.loss_watch is not None:
            with contextlib.suppress(RuntimeError):
                self.loss_watch.flush()

    def run_unmanaged(self, tensor: torch.Tensor, world_size: int, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> None:
        """Backpropagate a loss before any module was set up: fine on one process, refused where it would
        not sync."""
        if world_size > 1:
            raise MisconfigurationError(
                f"fabric.backward(loss): no module was set up with this Fabric, and this job runs {world_size} "
                "processes, so nothing would average these gradients across ranks: each rank would silently train its "
                "own copy. Set up the module the loss comes from first (`model = fabric.setup_module(model)`, or "
                "`model, optimizer = fabric.setup(model, optimizer)`); if every rank is meant to train its own copy, "
                "call loss.backward() yourself."
            )
        precision = self._strategy.precision
        if getattr(precision, "scaler", None) is not None:
            raise MisconfigurationError(
                "fabric.backward(loss) with no module set up: precision='16-mixed' scales the loss, and only an "
                "optimizer set up with fabric.setup unscales the gradients again, so the step would use gradients "
                "65536 times too large. Set up the model and optimizer (`model, optimizer = fabric.setup(model, "
                "optimizer)`), or use precision='bf16-mixed' (no loss scaling)."
            )
        anomaly = self._anomaly
        if anomaly is not None:
            anomaly.before_backward(tensor)
        precision.pre_backward(tensor).backward(*args, **kwargs)
        if anomaly is not None:
            anomaly.after_backward([])
        watch = self.loss_watch
        if watch is not None:
            watch.record(tensor)


__all__ = ["Backward"]
