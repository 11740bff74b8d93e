"""Activation checkpointing or torch.compile on a strategy (argv: strategy, ac|compile).

Run by tests/strategies/test_compile_checkpointing.py: test_activation_checkpointing_equivalence,
test_compile_equivalence.
"""

import sys
from collections.abc import Callable
from typing import Any

import torch
from compile_training import train
from job_runner import report
from model_parallel_models import FeedForward, parallelize

import phalanx
from phalanx.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

torch.set_num_threads(1)
kind, option = sys.argv[1], sys.argv[2]
OPTIONS: dict[str, dict[str, Any]] = {"ac": {"activation_checkpointing_policy": {FeedForward}},
                                      "compile": {"compile": True}}
options = OPTIONS[option]
strategy: Callable[[], Any]
strategy, devices = {
    "ddp": (lambda: DDPStrategy(**options), 2),
    "fsdp": (lambda: FSDPStrategy(**options), 2),
    "model_parallel": (lambda: ModelParallelStrategy(parallelize, 2, 2, **options), 4),
}[kind]
fabric = phalanx.Fabric(accelerator="cpu", devices=devices, strategy=strategy())
fabric.launch()
report(fabric, **train(fabric))
