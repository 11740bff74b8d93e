"""Accumulated training on the strategy in argv[1] (ddp or deepspeed_<stage>).

Run by tests/strategies/test_deepspeed.py: ddp_result, test_accumulated_training_equals_ddp_and_single_process.
"""

import sys

from deepspeed_mlp import CountingSGD, W, batches, flat, make_model, reference, strategy_from, train
from job_runner import report

import phalanx

name = sys.argv[1]
fabric = phalanx.Fabric(accelerator="cpu", devices=W, strategy=strategy_from(name))
fabric.launch()
model = make_model()
model, opt = fabric.setup(model, CountingSGD(model.parameters(), lr=0.1, momentum=0.9))
X, Y = batches(3)
train(fabric, model, opt, X, Y, range(3))
state = fabric.strategy.module_state_dict(model.module)
report(fabric, params=flat(state), reference=flat(reference(3, X, Y).state_dict()), calls=CountingSGD.calls)
