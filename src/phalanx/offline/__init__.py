"""Checkpoints opened offline: in one plain process, with no process group, no strategy and no run.

``sources`` opens any layout phalanx writes (and plain ``torch.save`` files and DCP directories) as a tree
of tensors read one at a time; ``summary`` says what a checkpoint holds (``phalanx ckpt inspect``);
``convert`` rewrites it in another layout (``phalanx ckpt convert``, ``phalanx consolidate``); ``lazy`` opens
a file the way ``torch.load(mmap=True)`` does (``phalanx.utilities.load._lazy_load``).

Why a package of its own, outside ``phalanx.checkpoint``: the checkpoint layer is what a training run calls
(save and load as collectives, through a strategy); these readers never take part in a run. They only read
the format the layer writes, so they import the layer's public surface (``phalanx.checkpoint`` and its
``format``, ``checksums``, ``storage``, ``protocol`` and backend reader modules) and nothing of its inner
workings.

Where it sits in the layers (``pyproject.toml``): above ``phalanx.checkpoint``, whose format it reads, and
beside ``phalanx.strategies``, which it never needs (and which never needs it); below ``phalanx.fabric``
(which reads a saved state's counters with ``summary.counters``) and ``phalanx.cli`` (the ``phalanx ckpt``
commands).
"""
