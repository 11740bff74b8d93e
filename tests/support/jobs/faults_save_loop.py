"""Saves a model every step, forever, to the path in argv[1], on argv[2] ranks with the strategy in argv[3]; rank 0
writes its pid to ``writer.pid`` and prints ``saved <step>`` after each save (run by tests/distributed/test_faults.py).
"""

import os
import sys

import torch

import phalanx

fabric = phalanx.Fabric(accelerator="cpu", devices=int(sys.argv[2]), strategy=sys.argv[3])
fabric.launch()
model = fabric.setup(torch.nn.Linear(1024, 2048))  # 8 MiB of weights: a save takes tens of ms
if fabric.global_rank == 0:
    with open("writer.pid", "w") as fh:
        fh.write(str(os.getpid()))
k = 0
while True:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(k))
    fabric.save(sys.argv[1], {"model": model, "step": k})
    if fabric.global_rank == 0:
        print(f"saved {k}", flush=True)
    k += 1
