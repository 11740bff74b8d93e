"""ModelParallelStrategy in the precision in argv[1].

Run by tests/strategies/test_model_parallel.py: test_precisions_train_with_tensor_parallel.
"""

import sys

import torch
from job_runner import report
from model_parallel_models import full_params, make_data, make_model, parallelize

import phalanx
from phalanx.strategies import ModelParallelStrategy

torch.set_num_threads(1)
fabric = phalanx.Fabric(accelerator="cpu", devices=2, precision=sys.argv[1],
                        strategy=ModelParallelStrategy(parallelize, 1, 2))
fabric.launch()
m = make_model()
model, opt = fabric.setup(m, torch.optim.Adam(m.parameters(), lr=0.01))
x, y = make_data()
losses = []
for i in range(0, 32, 8):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x[i : i + 8]), y[i : i + 8])
    fabric.backward(loss)
    fabric.clip_gradients(model, opt, max_norm=0.5)
    opt.step()
    losses.append(float(loss))
report(fabric, params=full_params(model), losses=losses, dtype=str(next(model.parameters()).dtype),
       scaler=fabric.strategy.precision.state_dict().get("scaler", {}).get("scale"))
