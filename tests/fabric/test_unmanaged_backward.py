"""``fabric.backward(loss)`` on a loss from a module that was never set up (meta-learning): allowed on one
process (nothing to sync), refused where gradients would silently not sync (see also the 2-rank job in
tests/fabric/test_anomaly.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phalanx import Fabric
from phalanx.utils.errors import MisconfigurationError


def test_single_process_backward_without_setup_matches_loss_backward() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    inner, x = nn.Linear(3, 1), torch.randn(5, 3)
    reference = nn.Linear(3, 1)
    reference.load_state_dict(inner.state_dict())
    fabric.backward((inner(x) ** 2).mean())
    (reference(x) ** 2).mean().backward()
    assert inner.weight.grad is not None and reference.weight.grad is not None
    assert torch.equal(inner.weight.grad, reference.weight.grad)
    # backward's own arguments pass through
    loss = (inner(x) ** 2).mean()
    fabric.backward(loss, retain_graph=True)
    fabric.backward(loss)
    assert torch.allclose(inner.weight.grad, 3 * reference.weight.grad)


@pytest.mark.gpu
def test_loss_scaler_without_setup_is_refused() -> None:
    fabric = Fabric(accelerator="cuda", devices=1, precision="16-mixed")
    inner = nn.Linear(3, 1).cuda()
    with pytest.raises(MisconfigurationError, match="scales the loss"):
        fabric.backward(inner(torch.randn(2, 3, device="cuda")).sum())


def test_several_processes_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # The world size as a DDP job reports it; the real 2-rank job is in test_anomaly.py.
    fabric = Fabric(accelerator="cpu", devices=1)
    monkeypatch.setattr(Fabric, "world_size", property(lambda self: 2))
    inner = nn.Linear(3, 1)
    with pytest.raises(MisconfigurationError, match=r"no module was set up with this Fabric, and this job runs 2 "
                                                     r"processes.*each rank would silently train its own copy"):
        fabric.backward(inner(torch.randn(2, 3)).sum())
    assert inner.weight.grad is None
