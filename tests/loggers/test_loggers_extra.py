"""MLflow and Weights & Biases loggers: a fit records metrics, hyperparameters and the checkpoint, and
each is read back through the library's own reader (MLflow's client against a SQLite store, a file
store and a real ``mlflow server`` on 127.0.0.1; W&B's offline run file, decoded with wandb's own
record schema)."""

from __future__ import annotations

import glob
import os
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from job_runner import free_port
from run_if import run_if
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx as L
from phalanx.callbacks import ModelCheckpoint

pytestmark = pytest.mark.timeout(600)


class Model(L.LightningModule):
    def __init__(self, lr: float = 0.05, hidden: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def fit(logger: Any, root: Path) -> tuple[L.Trainer, ModelCheckpoint]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", monitor="val_loss", save_last=True)
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, logger=logger, callbacks=[checkpoint], log_every_n_steps=2,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    trainer.fit(Model(lr=0.05, hidden=8), DataLoader(data, batch_size=8), DataLoader(data, batch_size=16))
    return trainer, checkpoint


def check_mlflow_run(tracking_uri: str, logger: Any, trainer: L.Trainer) -> None:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.05", "hidden": "8"}
    history = client.get_metric_history(logger.run_id, "train_loss")
    assert [m.step for m in history] == [2, 4, 6, 8, 10, 12, 14, 16]
    val = client.get_metric_history(logger.run_id, "val_loss")
    assert len(val) == 2 and val[-1].value == pytest.approx(float(trainer.callback_metrics["val_loss"]))
    folders = [a.path for a in client.list_artifacts(logger.run_id, "model/checkpoints")]
    assert {"model/checkpoints/last", "model/checkpoints/epoch=1-step=16"} <= set(folders)
    files = [a.path for a in client.list_artifacts(logger.run_id, "model/checkpoints/last")]
    assert files == ["model/checkpoints/last/last.ckpt"]
    local = client.download_artifacts(logger.run_id, "model/checkpoints/last/last.ckpt",
                                      str(Path(trainer.default_root_dir)))
    restored = Model.load_from_checkpoint(local)
    assert torch.equal(restored.net[0].weight, trainer.lightning_module.net[0].weight)


@run_if(module="mlflow")
# "default" is a SQLite store too (under save_dir); an explicit sqlite URI runs in slow.
@pytest.mark.parametrize("store", [pytest.param("sqlite", marks=pytest.mark.slow), "file", "default"])
def test_mlflow_records_metrics_hparams_and_checkpoints(
    store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    if store == "sqlite":
        uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
        logger = L.loggers.MLFlowLogger(experiment_name="porting", tracking_uri=uri, log_model=True,
                                        artifact_location=(tmp_path / "artifacts").as_uri())
    elif store == "default":  # no tracking_uri: a SQLite store under save_dir
        logger = L.loggers.MLFlowLogger(experiment_name="porting", save_dir=str(tmp_path / "mlruns"), log_model=True)
        uri = f"sqlite:///{(tmp_path / 'mlruns' / 'mlflow.db').absolute()}"
    else:
        uri = (tmp_path / "mlruns").absolute().as_uri()
        logger = L.loggers.MLFlowLogger(experiment_name="porting", tracking_uri=uri, log_model=True)
    trainer, _ = fit(logger, tmp_path)
    check_mlflow_run(uri, logger, trainer)


@pytest.mark.slow  # CI: the sqlite-store variant checks the same records
@run_if(module="mlflow")
def test_mlflow_against_a_real_tracking_server(tmp_path: Path) -> None:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "server-artifacts"), "--workers", "1"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "server.log", "w"),
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow server did not start"
            time.sleep(0.5)
        logger = L.loggers.MLFlowLogger(experiment_name="porting", tracking_uri=uri, log_model="all")
        trainer, _ = fit(logger, tmp_path)
        check_mlflow_run(uri, logger, trainer)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


# ---------------------------------------------------------------------------------------------- W&B
def wandb_records(run_file: str) -> list[Any]:
    """Every record of an offline run, decoded with wandb's own protobuf schema. The file is wandb's
    transaction log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of records framed
    as in LevelDB's log format (crc32c, length, type: full / first / middle / last)."""
    from wandb.proto import wandb_internal_pb2

    raw = Path(run_file).read_bytes()
    assert raw[:4] == b":W&B", raw[:8]
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        payload = raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@run_if(module="wandb")
def test_wandb_offline_records_metrics_hparams_and_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = L.loggers.WandbLogger(project="porting", save_dir=str(tmp_path), offline=True, log_model=True)
    trainer, checkpoint = fit(logger, tmp_path)
    files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, files
    # run.finish() hands the last records to wandb's service process, which writes them shortly after:
    # read once the run's closing "exit" record is there.
    deadline = time.monotonic() + 120
    while True:
        records = wandb_records(files[0])
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    history = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = r.history.item
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    losses = [h for h in history if "train_loss" in h]
    assert [h["trainer/global_step"] for h in losses] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert any("val_loss" in h for h in history)
    config: dict[str, Any] = {}
    for r in records:
        if r.WhichOneof("record_type") == "config":
            config.update({u.key: json.loads(u.value_json) for u in r.config.update})
    assert config["lr"] == 0.05 and config["hidden"] == 8
    artifacts = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert artifacts and all(a.type == "model" for a in artifacts)
    entries = {e.path for a in artifacts for e in a.manifest.contents}
    assert entries == {"model.ckpt"}
    aliases = {alias for a in artifacts for alias in a.aliases}
    assert {"latest", "best"} <= aliases
    assert os.path.getsize(checkpoint.best_model_path) > 0
    del trainer
