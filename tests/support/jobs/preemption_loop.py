"""A Fabric loop stopped by a signal or a kill (argv: strategy, rank, step, none|signal|kill).

Run by tests/fabric/test_preemption.py: reference,
test_a_signal_on_one_rank_stops_both_at_the_same_step_and_the_rerun_matches,
test_kill_9_under_max_restarts_resumes_from_the_snapshot.
"""

import os
import signal
import sys

import torch
from job_runner import report
from trainer_support import flat

import phalanx

strategy, signal_rank, signal_step, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
fabric = phalanx.Fabric(accelerator="cpu", devices=2, strategy=strategy, max_restarts=1 if mode == "kill" else 0)
fabric.launch()
fabric.seed_everything(3, verbose=False)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
model, optimizer = fabric.setup(model, optimizer)
g = torch.Generator().manual_seed(0)
data = torch.randn(64, 4, generator=g)
target = data.sum(1, keepdim=True).sin()
state = {"model": model, "optimizer": optimizer, "step": 0}
found = fabric.latest_checkpoint("ckpts", fabric.snapshot_dir)
if found is not None:
    fabric.load(found, state)
    report(fabric, resumed_from=str(found), resumed_at=state["step"], attempt=fabric.restart_count)
fabric.stop_requested()  # start listening before the first step (until the first call, SIGTERM ends the process)
while state["step"] < 20:
    first = (state["step"] * 4 + fabric.global_rank * 2) % 64
    rows = slice(first, first + 2)
    loss = torch.nn.functional.mse_loss(model(data[rows]), target[rows])
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    state["step"] += 1
    if mode == "kill":
        fabric.save_snapshot(state, state["step"], every_n_steps=1)  # per step, in /dev/shm: a restart loses nothing
    if fabric.global_rank == signal_rank and state["step"] == signal_step:
        if mode == "kill" and fabric.restart_count == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "signal" and not os.path.exists("signalled"):
            open("signalled", "w").close()
            os.kill(os.getpid(), signal.SIGTERM)
    if fabric.stop_requested():
        path = f"ckpts/step-{state['step']}.ckpt"
        fabric.save(path, state)
        assert fabric.preemption is not None
        report(fabric, stopped_at=state["step"], stop=fabric.preemption.describe())
        fabric.exit_preempted(path, step=state["step"])
report(fabric, weights=flat(model), step=state["step"], snapshots=str(fabric.snapshot_dir))
