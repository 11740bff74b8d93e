"""Calls ``freeze_at_exit`` twice and records, at exit, how often ``gc.freeze`` ran (``calls``) and how many objects
it froze (``frozen-launcher``); run by tests/utils/test_exiting.py."""

import atexit
import gc
import os

# Registered before phalanx registers anything, so it runs last (atexit is last in, first out): it sees what
# the final collection will see. ``gc.freeze`` moves every tracked object to the permanent generation.
atexit.register(lambda: open(f"frozen-{os.environ.get('RANK', 'launcher')}", "w").write(str(gc.get_freeze_count())))

import torch  # noqa: E402, F401  (imported after the recorder above, as a training script would)

real = gc.freeze
calls: list[int] = []


def counting_freeze() -> None:
    calls.append(1)
    real()


gc.freeze = counting_freeze
atexit.register(lambda: open("calls", "w").write(str(len(calls))))
from phalanx.utils.exiting import freeze_at_exit  # noqa: E402

freeze_at_exit()
freeze_at_exit()
assert gc.get_freeze_count() == 0, "froze before the exit"
