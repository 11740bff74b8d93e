"""fp8-mixed (emulated) on 2 ranks with the strategy in argv[1]: under FSDP a model created with empty_init, the Fabric
loop of tests/support/fp8_training.py (a checkpoint and a snapshot, each loaded back and the last steps redone), then
the Trainer: a fit run straight through, a fit that checkpoints half way and a fit resumed from that checkpoint.

Run by tests/precision/test_fp8.py: test_fp8_on_two_ranks.
"""

import sys
from pathlib import Path
from typing import Any

import torchao.float8
from fp8_training import CFG, LlamaModule, loader, module_params, precision, train_fabric
from job_runner import report
from llama_models import flat_params, make_llama

import phalanx
from phalanx.callbacks import ModelCheckpoint
from phalanx.precision import Float8Precision

STRATEGY = sys.argv[1]
WORLD, STEPS, HALF = 2, 6, 3

# Counts the scale precomputes FSDP's float8 all-gather asks for (the precision's after-step hook).
precomputes: list[int] = []
precompute = torchao.float8.precompute_float8_dynamic_scale_for_fsdp


def counted(module: Any) -> None:
    precomputes.append(1)
    precompute(module)


torchao.float8.precompute_float8_dynamic_scale_for_fsdp = counted

fabric = phalanx.Fabric(accelerator="cpu", devices=WORLD, strategy=STRATEGY, precision=precision("fp8-mixed"))
fabric.launch()
if STRATEGY == "fsdp":  # created on the meta device, converted, then given the values one process draws
    with fabric.init_module(empty_init=True):
        empty = make_llama(CFG)
    fp8 = fabric.strategy.precision
    assert isinstance(fp8, Float8Precision)
    report(fabric, empty_init_params=flat_params(fabric.setup_module(empty)).tolist(),
           empty_init_converted=list(fp8.converted))
    fp8.converted.clear()  # what train_fabric reports is its own model's layers
    # `empty` stays alive: no optimizer steps it, so its scales are never precomputed (the count below).
report(fabric, **train_fabric(fabric, Path("fabric")), precomputes=len(precomputes))


def fit(max_steps: int, ckpt_path: str | None = None, save: bool = False) -> LlamaModule:
    module = LlamaModule()
    callbacks = [ModelCheckpoint(dirpath="trainer-ckpt", every_n_train_steps=HALF, save_top_k=-1)] if save else []
    trainer = phalanx.Trainer(
        accelerator="cpu", devices=WORLD, strategy=STRATEGY, precision=precision("fp8-mixed"), max_steps=max_steps,
        logger=False, enable_checkpointing=save, callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, loader(WORLD, STEPS), ckpt_path=ckpt_path)
    return module


straight = fit(STEPS)
fit(HALF, save=True)
resumed = fit(STEPS, ckpt_path=f"trainer-ckpt/epoch=0-step={HALF}.ckpt")
report(fabric, trainer_losses=straight.losses, trainer_resumed_losses=resumed.losses,
       trainer_params=module_params(straight.model), trainer_resumed_params=module_params(resumed.model))
