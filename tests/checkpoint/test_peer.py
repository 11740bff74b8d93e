"""The state one replica group hands another (phalanx.checkpoint.peer): what arrives is put in place only when it is
whole, of this format and for this rank; it travels as plain values, so the receiver opens it with weights_only."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed._serialization import _streaming_save

from phalanx.checkpoint import peer
from phalanx.checkpoint.format import FORMAT_VERSION
from phalanx.distributed.replica_groups import load_payload
from phalanx.strategies import SingleDeviceStrategy
from phalanx.utils.errors import CheckpointError, CorruptCheckpointError


def owner() -> SingleDeviceStrategy:
    strategy = SingleDeviceStrategy()
    strategy.configure(device_type="cpu", devices=1, num_nodes=1, precision="32-true")
    return strategy


def trained(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(seed + 1):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": seed + 1, "epoch": 0}


def over_the_wire(payload: dict[str, Any]) -> Any:
    buffer = io.BytesIO()
    _streaming_save(payload, buffer)
    return load_payload(buffer.getvalue())  # what the receiving group does: plain values only, writable tensors


def test_a_live_state_arrives_whole_and_in_place() -> None:
    source, target = trained(3), trained(0)
    strategy = owner()
    payload = over_the_wire(peer.build(strategy, source, strategy.local_state))
    assert payload["format_version"] == FORMAT_VERSION and peer.nbytes(payload) > 0
    params = [id(p) for p in target["model"].parameters()]
    peer.apply(strategy, target, payload, "replica group 2")
    for a, b in zip(source["model"].parameters(), target["model"].parameters()):
        assert torch.equal(a, b)
    assert [id(p) for p in target["model"].parameters()] == params  # in place
    assert target["step"] == 4 and target["scheduler"].state_dict() == source["scheduler"].state_dict()
    moments = [s["exp_avg"] for s in target["optimizer"].state.values()]
    assert all(torch.equal(m, n) for m, n in zip(moments, (s["exp_avg"] for s in source["optimizer"].state.values())))


def test_a_damaged_tensor_is_refused_and_nothing_is_applied() -> None:
    source, target = trained(3), trained(0)
    strategy = owner()
    payload = over_the_wire(peer.build(strategy, source, strategy.local_state))
    payload["entries"]["model"]["weight"].view(-1)[0] += 1.0
    before = [p.detach().clone() for p in target["model"].parameters()]
    refused = r"from replica group 2 is corrupt: tensor 'weight' of entry 'model' does not match the checksum .* " \
              r"Nothing of it was applied"
    with pytest.raises(CorruptCheckpointError, match=refused):
        peer.apply(strategy, target, payload, "replica group 2")
    assert all(torch.equal(a, b) for a, b in zip(before, target["model"].parameters())) and target["step"] == 1


@pytest.mark.parametrize(("key", "value", "message"), [
    ("format_version", FORMAT_VERSION - 1, r"is of format 2; this phalanx reads format 3\. Every replica group must "
                                           r"run the same phalanx version"),
    ("world_size", 2, r"does not fit this group: world_size 2 \(here 1\)"),
    ("strategy", "fsdp", r"does not fit this group: strategy 'fsdp' \(here 'single'\)"),
])
def test_a_state_of_another_version_or_shape_is_refused(key: str, value: Any, message: str) -> None:
    strategy = owner()
    payload = peer.build(strategy, trained(1), strategy.local_state)
    payload[key] = value
    with pytest.raises(CheckpointError, match=message):
        peer.apply(strategy, trained(0), payload, "replica group 1")


def test_a_state_missing_an_entry_is_refused() -> None:
    strategy = owner()
    source = trained(1)
    del source["scheduler"]
    payload = peer.build(strategy, source, strategy.local_state)
    with pytest.raises(CheckpointError, match=r"has no \['scheduler'\]"):
        peer.apply(strategy, trained(0), payload, "replica group 1")


def test_only_plain_values_travel() -> None:
    strategy = owner()
    with pytest.raises(CheckpointError, match="cannot hold"):
        peer.build(strategy, {"model": nn.Linear(2, 2), "config": object()}, strategy.local_state)
