"""Leaving the interpreter without the last garbage collection.

At exit CPython runs its cyclic garbage collector over every object still alive. After ``import torch``
that is over a million objects (dynamo, sympy, the operator registry), walked just before the operating
system frees the memory anyway. A job pays it in every rank and then again in the launcher that waits for
them, after each restart too (bench/startup.py measures it). Freezing the objects at exit
(``gc.freeze``) takes them out of that walk.

What does not change: atexit handlers run (phalanx finalizes loggers and leaves the process group in its
own), objects that are not in a reference cycle are still freed, and buffered files are flushed. What
does: an object in a reference cycle that is still alive at exit is not finalized, which Python never
promised (the ``__del__`` documentation).
"""

from __future__ import annotations

import atexit
import gc


def freeze_at_exit() -> None:
    """Skip the final cyclic collection of this process (idempotent)."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
