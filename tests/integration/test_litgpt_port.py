"""LitGPT 0.5.13 ported to phalanx by changing its imports only, against the same scripts on Lightning 2.6.6.

The slow tier's own environments come from ``bash scripts/litgpt_env.sh`` (``/tmp/phalanx-litgpt``, or
``PHALANX_LITGPT_ROOT``): ``venv-port`` holds litgpt installed without its dependencies (so Lightning is
absent) plus the handful of packages it imports, ``venv-lightning`` the same plus Lightning. The test copies
the installed ``litgpt`` package, rewrites every ``lightning`` import to the phalanx name with the same tail
(docs/porting.md), and runs LitGPT's own pretraining, full finetuning and LoRA finetuning entry points
(tests/integration/litgpt_port_driver.py) on a tiny randomly initialised GPT, a text file and a character
tokenizer the test writes. Each run's per-iteration losses (LitGPT's CSV logger) must equal Lightning's for
the same seed to 1e-5 (fp32).
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("litgpt_port_driver.py")
ROOT = Path(os.environ.get("PHALANX_LITGPT_ROOT", "/tmp/phalanx-litgpt"))
PORT_PY = ROOT / "venv-port" / "bin" / "python"
LIGHTNING_PY = ROOT / "venv-lightning" / "bin" / "python"
TOL = 1e-5

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not (PORT_PY.exists() and LIGHTNING_PY.exists()),
                       reason=f"the LitGPT port environments are absent: run `bash scripts/litgpt_env.sh` "
                              f"(creates {ROOT}/venv-port and {ROOT}/venv-lightning)"),
]

# `from lightning.fabric.X import` / `from lightning.pytorch.X import` / `from lightning import` /
# `import lightning as L`: the same tail under phalanx (docs/porting.md, "Names a Fabric program imports").
_FROM = re.compile(r"^(\s*)from lightning(?:\.(?:fabric|pytorch))?(\.[\w.]+)? import ", re.MULTILINE)
_IMPORT = re.compile(r"^(\s*)import lightning as L$", re.MULTILINE)
_ANY = re.compile(r"^\s*(?:from|import) lightning(?:\.|\s|$)", re.MULTILINE)


def port_source(src: Path, dst: Path) -> int:
    """Copy the litgpt package from src to dst with its lightning imports rewritten; returns the files changed."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    changed = 0
    for path in dst.rglob("*.py"):
        text = path.read_text()
        new = _FROM.sub(lambda m: f"{m.group(1)}from phalanx{m.group(2) or ''} import ", text)
        new = _IMPORT.sub(lambda m: f"{m.group(1)}import phalanx as L", new)
        assert not _ANY.search(new), f"{path}: a lightning import is left: {_ANY.search(new)}"
        if new != text:
            path.write_text(new)
            changed += 1
    return changed


def site_litgpt(python: Path) -> Path:
    # found, not imported: the port environment's litgpt cannot import as installed (it needs lightning)
    find = "import importlib.util as u; print(u.find_spec('litgpt').submodule_search_locations[0])"
    out = subprocess.run([str(python), "-c", find],
                         capture_output=True, text=True, check=True, timeout=300)
    return Path(out.stdout.strip())


SEQ_LEN = 16
TINY_GPT = {"name": "tiny-phalanx", "block_size": SEQ_LEN, "n_layer": 2, "n_head": 4, "n_embd": 32,
            "rotary_percentage": 0.25, "parallel_residual": True, "bias": True}
OPTIMIZER = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 3e-3, "weight_decay": 0.01}}


def pretrain_config(work: Path, out: Path, devices: int, vocab: int) -> dict[str, Any]:
    micro = 2
    return {
        "model_name": "tiny-phalanx",
        "model_config": {**TINY_GPT, "vocab_size": vocab, "padded_vocab_size": vocab},
        "out_dir": str(out), "precision": "32-true", "devices": devices, "seed": 42, "logger_name": "csv",
        "tokenizer_dir": str(work / "tokenizer"),
        "data": {"class_path": "litgpt_port_driver.TokenBlocks", "init_args": {"path": str(work / "pretrain.txt")}},
        # two micro batches per optimizer step on every world size: no_backward_sync is exercised
        "train": {"save_interval": 4, "log_interval": 1, "global_batch_size": micro * devices * 2,
                  "micro_batch_size": micro, "max_tokens": 12 * micro * SEQ_LEN * devices, "max_norm": 1.0,
                  "min_lr": 1e-4, "lr_warmup_steps": 2, "tie_embeddings": False},
        "eval": {"interval": 3, "max_iters": 2, "initial_validation": False, "final_validation": True},
        "optimizer": OPTIMIZER,
    }


def finetune_config(kind: str, work: Path, out: Path, devices: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "out_dir": str(out), "precision": "32-true", "devices": devices, "seed": 1337, "logger_name": "csv",
        "data": {"class_path": "litgpt.data.JSON", "init_args": {
            "json_path": str(work / "sft.json"), "val_split_fraction": 0.25, "num_workers": 0, "seed": 7}},
        "train": {"save_interval": None, "log_interval": 1, "global_batch_size": 4, "micro_batch_size": 2,
                  "lr_warmup_steps": 2, "epochs": 1, "max_seq_length": SEQ_LEN, "min_lr": 1e-4},
        "eval": {"interval": 4, "max_new_tokens": 4, "max_iters": 2, "initial_validation": False,
                 "final_validation": True},
        "optimizer": OPTIMIZER,
    }
    if kind == "lora":
        config.update(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_query=True, lora_key=True, lora_value=True,
                      lora_projection=True, lora_mlp=True, lora_head=True)
    return config


@pytest.fixture(scope="module")
def envs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """The environment variables of a port run and of a Lightning run, and a prepared work dir."""
    base = tmp_path_factory.mktemp("litgpt")
    port_src, driver_dir = base / "port_src", base / "driver"
    port_src.mkdir()
    driver_dir.mkdir()
    shutil.copy(DRIVER, driver_dir / DRIVER.name)
    assert port_source(site_litgpt(PORT_PY), port_src / "litgpt") > 10
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "PL_", "LT_", "MASTER_", "RANK",
                                                                        "WORLD_SIZE", "LOCAL_RANK", "PYTHON"))}
    # TORCH_COMPILE_DISABLE: litgpt.pretrain wraps the model in torch.compile; both frameworks then run the
    # same eager kernels (compiling a tiny model with inductor on 2 CPU cores costs minutes, nothing more).
    common = {**clean, "TORCH_COMPILE_DISABLE": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
              "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1"}
    port = {**common, "PYTHONPATH": os.pathsep.join(map(str, [port_src, REPO / "src", driver_dir])),
            "_python": str(PORT_PY)}
    ref = {**common, "PYTHONPATH": str(driver_dir), "_python": str(LIGHTNING_PY)}
    work = base / "work"
    subprocess.run([str(LIGHTNING_PY), str(driver_dir / DRIVER.name), "prepare", str(work)], check=True,
                   timeout=300, env={k: v for k, v in ref.items() if k != "_python"})
    vocab = subprocess.run([str(LIGHTNING_PY), "-c", f"from litgpt import Tokenizer; "
                            f"print(Tokenizer({str(work / 'tokenizer')!r}).vocab_size)"],
                           capture_output=True, text=True, check=True, timeout=300).stdout.strip()
    return {"port": port, "lightning": ref, "work": {"dir": str(work), "base": str(base), "vocab": vocab}}


def test_lightning_is_absent_from_the_port_environment(envs: dict[str, dict[str, str]]) -> None:
    env = {k: v for k, v in envs["port"].items() if k != "_python"}
    out = subprocess.run([str(PORT_PY), "-c", "import lightning"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode != 0 and "No module named 'lightning'" in out.stderr, out.stderr
    out = subprocess.run([str(PORT_PY), "-c", "import litgpt.pretrain, litgpt.finetune.full, litgpt.finetune.lora, "
                          "phalanx, sys; print(litgpt.pretrain.L is phalanx)"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-3000:]


def run(envs: dict[str, dict[str, str]], which: str, command: list[str], config: dict[str, Any],
        out: Path, strategy: str | None = None) -> tuple[dict[int, float], float]:
    """``python -m litgpt COMMAND --config CONFIG`` under `which` ("port" or "lightning"); the losses LitGPT
    logged, by iteration, and the seconds it took."""
    env = dict(envs[which])
    python = env.pop("_python")
    cfg = out.parent / f"{out.name}.json"
    cfg.write_text(json.dumps(config, indent=1))  # JSON is YAML: jsonargparse reads it as a config file
    t0 = time.perf_counter()
    driver = str(Path(env["PYTHONPATH"].split(os.pathsep)[-1]) / DRIVER.name)
    if strategy:
        env["LITGPT_TEST_STRATEGY"] = strategy
    proc = subprocess.run([python, driver, *command, "--config", str(cfg)], capture_output=True, text=True,
                          env=env, timeout=800, cwd=str(out.parent))
    took = time.perf_counter() - t0
    (out.parent / f"{out.name}.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, f"{which} {command} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return losses(out), took


def losses(out: Path) -> dict[int, float]:
    files = sorted((out / "logs" / "csv").glob("version_*/metrics.csv"))
    assert files, f"no metrics.csv under {out / 'logs' / 'csv'}"
    result: dict[int, float] = {}
    with open(files[-1], newline="") as fh:
        for row in csv.DictReader(fh):
            if row.get("loss") not in (None, ""):
                result[int(float(row["iter"]))] = float(row["loss"])
    assert result, f"no loss rows in {files[-1]}"
    return result


def compare(port: dict[int, float], ref: dict[int, float]) -> float:
    assert sorted(port) == sorted(ref), f"logged iterations differ: port {sorted(port)}, lightning {sorted(ref)}"
    worst = max(abs(port[i] - ref[i]) for i in ref)
    assert worst <= TOL, "per-iteration losses differ:\n" + "\n".join(
        f"  iter {i}: port {port[i]:.8f}  lightning {ref[i]:.8f}  diff {port[i] - ref[i]:+.2e}" for i in sorted(ref))
    return worst


def pretrained(envs: dict[str, dict[str, str]], which: str, devices: int,
               strategy: str | None = None) -> tuple[dict[int, float], float, Path]:
    """Pretraining once per (framework, world size, strategy); the finetuning tests start from its final
    checkpoint. ``strategy=None``: the strategy litgpt.pretrain chooses itself."""
    tag = f"{which}-{devices}-{strategy or 'litgpt'}"
    out = Path(envs["work"]["base"]) / f"pretrain-{tag}"
    cache = _PRETRAINED.get(tag)
    if cache is None:
        work = Path(envs["work"]["dir"])
        config = pretrain_config(work, out, devices, int(envs["work"]["vocab"]))
        found, took = run(envs, which, ["pretrain"], config, out, strategy)
        cache = _PRETRAINED[tag] = (found, took, out / "final")
    return cache


_PRETRAINED: dict[str, tuple[dict[int, float], float, Path]] = {}


def converted(envs: dict[str, dict[str, str]], which: str) -> Path:
    """``litgpt convert_pretrained_checkpoint`` of the 1-process pretraining, in `which`'s environment: LitGPT's
    documented step between pretraining and finetuning (the finetuning scripts read a plain model state dict).

    On Lightning it needs ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``: Lightning's ``fabric.save`` pickles the plain
    ``DataLoader`` litgpt keeps in its state, which LitGPT's own converter (``torch.load``, weights_only by
    default since torch 2.6) then refuses. phalanx saves the loader's ``state_dict()`` instead."""
    out = Path(envs["work"]["base"]) / f"converted-{which}"
    if not out.exists():
        _, _, final = pretrained(envs, which, 1)
        env = dict(envs[which])
        python = env.pop("_python")
        if which == "lightning":
            env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
        proc = subprocess.run([python, "-m", "litgpt", "convert_pretrained_checkpoint", str(final), str(out)],
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_pretrain_on_one_process_matches_lightning(envs: dict[str, dict[str, str]]) -> None:
    port, port_s, _ = pretrained(envs, "port", 1)
    ref, ref_s, _ = pretrained(envs, "lightning", 1)
    worst = compare(port, ref)
    print(f"pretrain x1: {len(ref)} logged iterations, max |diff| {worst:.2e}; phalanx {port_s:.0f}s, "
          f"lightning {ref_s:.0f}s", file=sys.stderr)


def test_pretrain_on_two_processes_ddp_matches_lightning(envs: dict[str, dict[str, str]]) -> None:
    """The same script with ``Fabric(strategy="ddp")`` on both (see litgpt_port_driver.force_strategy)."""
    port, port_s, _ = pretrained(envs, "port", 2, "ddp")
    ref, ref_s, _ = pretrained(envs, "lightning", 2, "ddp")
    worst = compare(port, ref)
    print(f"pretrain x2 ddp: {len(ref)} logged iterations, max |diff| {worst:.2e}; phalanx {port_s:.0f}s, "
          f"lightning {ref_s:.0f}s", file=sys.stderr)


def test_pretrain_on_two_processes_with_litgpts_fsdp_matches_lightning_ddp(envs: dict[str, dict[str, str]]) -> None:
    """On 2 processes litgpt.pretrain builds ``FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full",
    sharding_strategy="HYBRID_SHARD")``. Lightning refuses FSDP on CPU ("FSDP is only available on GPU"), so the
    reference is Lightning DDP, which trains the same model on the same data split identically. The port runs
    litgpt's FSDP strategy unchanged. Both start from LitGPT's own random initialization: under FSDP litgpt
    creates the model on the meta device and phalanx materializes it with the values one process draws
    (tests/strategies/test_meta_init.py), which Lightning DDP draws too."""
    port, port_s, _ = pretrained(envs, "port", 2, None)
    ref, ref_s, _ = pretrained(envs, "lightning", 2, "ddp")
    worst = compare(port, ref)
    print(f"pretrain x2 litgpt FSDP (HYBRID_SHARD) vs Lightning ddp: {len(ref)} logged iterations, max |diff| "
          f"{worst:.2e}; phalanx {port_s:.0f}s, lightning {ref_s:.0f}s", file=sys.stderr)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_finetune_on_one_process_matches_lightning(envs: dict[str, dict[str, str]], kind: str) -> None:
    results = {}
    for which in ("port", "lightning"):
        ckpt = converted(envs, which)
        out = Path(envs["work"]["base"]) / f"{kind}-{which}-1"
        config = finetune_config(kind, Path(envs["work"]["dir"]), out, 1)
        results[which] = run(envs, which, [f"finetune_{kind}", str(ckpt)], config, out)
    worst = compare(results["port"][0], results["lightning"][0])
    print(f"finetune {kind} x1: {len(results['lightning'][0])} iterations, max |diff| {worst:.2e}; "
          f"phalanx {results['port'][1]:.0f}s, lightning {results['lightning'][1]:.0f}s", file=sys.stderr)


def with_initial_lora(envs: dict[str, dict[str, str]], ckpt: Path, config: dict[str, Any]) -> Path:
    """`ckpt` plus LoRA matrices one process draws (LitGPT's own LoRA ``GPT``, seed 1337): what the 2-process
    LoRA comparison starts from on both sides. LitGPT's ``load_checkpoint(..., strict=False)`` loads whatever
    model keys the file holds, so ``lora_A``/``lora_B`` come from it instead of the meta-device init (see
    test_finetune_on_two_processes_matches_lightning)."""
    out = ckpt.parent / f"{ckpt.name}-with-lora"
    if not out.exists():
        shutil.copytree(ckpt, out)
        lora = {k: v for k, v in config.items() if k.startswith("lora_")}
        code = ("import json, sys, torch; from litgpt.lora import GPT, Config; d = sys.argv[1]; "
                "cfg = Config.from_file(d + '/model_config.yaml', **json.loads(sys.argv[2])); torch.manual_seed(1337); "
                "lora = {k: v for k, v in GPT(cfg).state_dict().items() if 'lora_' in k}; "
                "sd = torch.load(d + '/lit_model.pth', weights_only=True); sd.update(lora); "
                "torch.save(sd, d + '/lit_model.pth'); print(len(lora))")
        env = dict(envs["lightning"])
        python = env.pop("_python")
        proc = subprocess.run([python, "-c", code, str(out), json.dumps(lora)], capture_output=True, text=True,
                              env=env, timeout=300)
        assert proc.returncode == 0 and int(proc.stdout.split()[-1]) > 0, proc.stderr[-4000:]
    return out


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_finetune_on_two_processes_matches_lightning(envs: dict[str, dict[str, str]], kind: str) -> None:
    """On 2 processes finetune_full builds ``FSDPStrategy(auto_wrap_policy={Block},
    activation_checkpointing_policy={Block}, state_dict_type="full", limit_all_gathers=True, cpu_offload=False)``,
    which Lightning refuses on CPU (its reference is Lightning DDP, as for pretraining), and finetune_lora
    ``ModelParallelStrategy(parallelize_fn, data_parallel_size=2, tensor_parallel_size=1)``, which Lightning runs
    on CPU (the reference runs it too). Both sides read the same converted checkpoint.

    finetune_lora creates the model on the meta device for 2 ranks, and ``lora_A`` is in no checkpoint, so
    its initial values are the meta-device materialization's. phalanx's are those one process draws
    (tests/strategies/test_meta_init.py); Lightning on CPU has no DTensor random-number tracker and fills
    every rank's shard with the same numbers (rows 2-3 of a 4-row ``lora_A`` repeat rows 0-1), a deliberate
    difference (docs/porting.md) that moves the losses by ~1e-2 from iteration 3. The comparison therefore
    starts both from the same LoRA matrices (:func:`with_initial_lora`), as the FSDP pretraining comparison
    starts from given weights. It then covers the rest: training, final validation, the LoRA checkpoint, and
    ``merge_lora``'s ``Fabric(devices=1)`` on rank 0 inside the 2-process job."""
    ckpt = converted(envs, "lightning")
    results = {}
    for which, strategy in (("port", None), ("lightning", "ddp" if kind == "full" else None)):
        out = Path(envs["work"]["base"]) / f"{kind}-{which}-2"
        config = finetune_config(kind, Path(envs["work"]["dir"]), out, 2)
        start = with_initial_lora(envs, ckpt, config) if kind == "lora" else ckpt
        results[which] = run(envs, which, [f"finetune_{kind}", str(start)], config, out, strategy)
        if kind == "lora":  # merge_lora ran on rank 0 inside the job and wrote the merged model
            assert (out / "final" / "lit_model.pth").is_file(), f"{which}: merge_lora wrote no lit_model.pth"
    worst = compare(results["port"][0], results["lightning"][0])
    if kind == "lora":  # and the merged models agree
        base = Path(envs["work"]["base"])
        merged = {which: torch.load(base / f"lora-{which}-2" / "final" / "lit_model.pth", weights_only=True)
                  for which in ("port", "lightning")}
        assert merged["port"].keys() == merged["lightning"].keys()
        for key, ref in merged["lightning"].items():
            torch.testing.assert_close(merged["port"][key], ref, rtol=0, atol=TOL, msg=key)
    print(f"finetune {kind} x2: {len(results['lightning'][0])} iterations, max |diff| {worst:.2e}; "
          f"phalanx {results['port'][1]:.0f}s, lightning {results['lightning'][1]:.0f}s", file=sys.stderr)
