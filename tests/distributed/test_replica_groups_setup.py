"""Fault tolerance asked for where it cannot run is refused before any process starts, saying how to fix it: torchft
missing (Fabric, Trainer and ``phalanx run --replica-groups``), no lighthouse or group named, a backend that cannot be a
replica group. And the data a group reads: its own shard, whose position a healed group takes from its peer."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import phalanx as L
from phalanx.cli.commands import main
from phalanx.distributed.replica_groups import FaultTolerance
from phalanx.fabric.data import FabricDataLoader, distribute_dataloader
from phalanx.utils.errors import MisconfigurationError

GROUP_ENV = {"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:1", "REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "3"}
INSTALL = (r"fault_tolerance needs torchft, which is not installed \(.*\)\. Install it with "
           r"`pip install 'phalanx\[ft\]'` \(torchft==0\.2\.0\), or run without fault_tolerance\.")


@pytest.fixture()
def group_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in GROUP_ENV.items():
        monkeypatch.setenv(key, value)


@pytest.fixture()
def no_torchft(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)  # `import torchft` raises ImportError


@pytest.mark.usefixtures("group_env", "no_torchft")
def test_a_missing_torchft_is_named_with_the_install_command() -> None:
    with pytest.raises(MisconfigurationError, match=INSTALL):
        L.Fabric(accelerator="cpu", devices=1, fault_tolerance=FaultTolerance())
    with pytest.raises(MisconfigurationError, match=INSTALL):
        L.Trainer(accelerator="cpu", devices=1, fault_tolerance=True, logger=False)


@pytest.mark.usefixtures("no_torchft")
def test_the_launcher_refuses_replica_groups_without_torchft(tmp_path: pytest.TempPathFactory,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"  # type: ignore[operator]
    script.write_text("print('never runs')\n")
    assert main(["run", "--replica-groups", "2", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("phalanx run: fault_tolerance needs torchft") and "pip install 'phalanx[ft]'" in err


@pytest.mark.usefixtures("group_env")
@pytest.mark.parametrize("missing", ["TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS"])
def test_a_group_that_does_not_know_its_job_is_refused(monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    pytest.importorskip("torchft")
    monkeypatch.delenv(missing)
    with pytest.raises(MisconfigurationError, match="phalanx run --replica-groups N"):
        L.Fabric(accelerator="cpu", devices=1, fault_tolerance=True)


@pytest.mark.usefixtures("group_env")
def test_settings_that_can_never_commit_are_refused() -> None:
    pytest.importorskip("torchft")
    with pytest.raises(MisconfigurationError, match="min_replica_groups=4 but the job has 3 replica groups"):
        L.Fabric(accelerator="cpu", devices=1, fault_tolerance=FaultTolerance(min_replica_groups=4))
    with pytest.raises(MisconfigurationError, match="min_replica_groups=0"):
        FaultTolerance(min_replica_groups=0)


@pytest.mark.usefixtures("group_env")
def test_a_backend_that_cannot_be_a_replica_group_is_refused() -> None:
    pytest.importorskip("torchft")
    with pytest.raises(MisconfigurationError, match="fault_tolerance is not supported with strategy='deepspeed'"):
        L.Fabric(accelerator="cpu", devices=1, strategy="deepspeed", fault_tolerance=True)


def test_a_healed_loader_goes_on_from_its_peers_position_at_the_next_batch() -> None:
    data = TensorDataset(torch.arange(48.0))
    # Group 1 of 3 (one rank each): shard 1 of a sampler over every group, as torchft.DistributedSampler splits it.
    mine = FabricDataLoader(distribute_dataloader(DataLoader(data, batch_size=2, shuffle=True), 3, 1, seed=5,
                                                  resumable=True), None)
    peer = FabricDataLoader(distribute_dataloader(DataLoader(data, batch_size=2, shuffle=True), 3, 1, seed=7,
                                                  resumable=True), None)
    expected = [b[0].tolist() for b in peer]  # the peer's seed (7): the order a healed group must follow
    it = iter(mine)
    next(it)  # this group's first batch (its own seed): then it heals to the peer's position after 3 batches
    peer_state = {"epoch": 0, "batches": 3, "seed": 7}
    mine.load_state_dict(peer_state)
    assert [b[0].tolist() for b in it] == expected[3:]
    assert mine.state_dict() == {"epoch": 1, "batches": 0, "seed": 7}
