"""``phalanx fit|validate|test|predict --config`` and ``LightningCLI``: the digits model trained from
examples/configs/digits.yaml, checkpoints reused by the other subcommands, config errors reported."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from job_runner import REPO
from run_if import run_if

import phalanx as L

pytestmark = [pytest.mark.timeout(600), run_if(module="jsonargparse")]
CONFIG = REPO / "examples" / "configs" / "digits.yaml"


def phalanx_cli(*args: str, cwd: Path, timeout: float = 500) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "examples")])}
    env.pop("PHALANX_SEED", None)
    return subprocess.run([sys.executable, "-m", "phalanx.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def last_metric(log_dir: Path, name: str) -> float:
    rows = list(csv.DictReader((log_dir / "metrics.csv").open()))
    return float([r for r in rows if r.get(name)][-1][name])


@pytest.mark.slow  # CI: test_phalanx_fit_on_two_processes runs the same config path
def test_phalanx_fit_from_yaml_trains_digits_then_test_validate_predict(tmp_path: Path) -> None:
    fit = phalanx_cli("fit", "--config", str(CONFIG), "--trainer.max_epochs=3", "--model.init_args.epochs=3",
                      cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-4000:]
    log_dir = tmp_path / "runs" / "cli_digits" / "csv" / "version_0"
    assert last_metric(log_dir, "val_acc") >= 0.9
    saved = (log_dir / "config.yaml").read_text()
    assert "max_epochs: 3" in saved and "seed_everything: 42" in saved and "digits_cli.DigitsModel" in saved
    ckpt = log_dir / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()
    test = phalanx_cli("test", "--config", str(CONFIG), f"--ckpt_path={ckpt}", cwd=tmp_path)
    assert test.returncode == 0, test.stderr[-4000:]
    assert float(test.stdout.split("test_acc=")[1].split(",")[0].split()[0]) >= 0.9
    validate = phalanx_cli("validate", "--config", str(CONFIG), f"--ckpt_path={ckpt}", cwd=tmp_path)
    assert validate.returncode == 0, validate.stderr[-4000:]
    accuracy = float(validate.stdout.split("val_acc=")[1].split(",")[0].split()[0])
    assert accuracy == pytest.approx(last_metric(log_dir, "val_acc"), abs=1e-6)
    predict = phalanx_cli("predict", "--config", str(CONFIG), f"--ckpt_path={ckpt}", cwd=tmp_path)
    assert predict.returncode == 0, predict.stderr[-4000:]


def test_phalanx_fit_on_two_processes(tmp_path: Path) -> None:
    fit = phalanx_cli("fit", "--config", str(CONFIG), "--trainer.max_epochs=1", "--trainer.devices=2",
                      "--trainer.strategy=ddp", cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-4000:]
    log_dir = tmp_path / "runs" / "cli_digits" / "csv" / "version_0"
    assert last_metric(log_dir, "val_acc") > 0.5 and (log_dir / "checkpoints" / "last.ckpt").is_file()


def test_config_errors_name_the_bad_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    # In this process: `phalanx fit` parses its arguments before anything starts, as the command does
    # (test_phalanx_fit_on_two_processes runs the command itself).
    from phalanx.cli import main

    monkeypatch.syspath_prepend(str(REPO / "examples"))
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> tuple[Any, str, str]:
        with pytest.raises(SystemExit) as ended:
            main(list(args))
        out = capsys.readouterr()
        return ended.value.code, out.out, out.err

    code, _, err = run("fit", "--config", str(CONFIG), "--trainer.max_epoch=3")
    assert code != 0 and "max_epoch" in err
    typo = tmp_path / "typo.yaml"
    typo.write_text(CONFIG.read_text().replace("hidden: 128", "hiden: 128"))
    code, _, err = run("fit", "--config", str(typo))
    assert code != 0 and "hiden" in err
    code, out, _ = run("fit", "--config", str(CONFIG), "--print_config")
    assert code in (0, None) and "num_sanity_val_steps" in out and "class_path" in out


class Small(L.LightningModule):
    def __init__(self, width: int = 4, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(3, width)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> Any:
        data = torch.utils.data.TensorDataset(torch.randn(16, 3))
        return torch.utils.data.DataLoader(data, batch_size=4)


def test_lightning_cli_in_a_script_with_optimizer_from_the_command_line(tmp_path: Path) -> None:
    cli = L.LightningCLI(Small, run=False, args=["--model.width=6", "--trainer.max_epochs=1",
                                                 "--trainer.logger=false", "--trainer.enable_progress_bar=false",
                                                 f"--trainer.default_root_dir={tmp_path}", "--seed_everything=3",
                                                 "--optimizer=torch.optim.Adam", "--optimizer.lr=0.01"])
    assert cli.model.hparams.width == 6 and cli.trainer.max_epochs == 1
    cli.trainer.fit(cli.model)
    assert isinstance(cli.trainer.optimizers[0], torch.optim.Adam)
    assert cli.trainer.optimizers[0].param_groups[0]["lr"] == 0.01 and cli.trainer.global_step == 4
