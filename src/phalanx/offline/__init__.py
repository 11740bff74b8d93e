"""Checkpoints handled offline: in one plain process, with no process group, no strategy and no run.

``summary`` says what a checkpoint holds (``phalanx ckpt inspect``); ``convert`` rewrites it in another layout
(``phalanx ckpt convert``, and ``phalanx consolidate``, which is ``convert(to="single")``); ``lazy`` opens a
file the way ``torch.load(mmap=True)`` does (``phalanx.utilities.load._lazy_load``). All of them read through
the checkpoint layer's one reader (``phalanx.checkpoint.sources``: any layout, tensor by tensor).

Why a package of its own, outside ``phalanx.checkpoint``: the checkpoint layer is what a training run calls
(save and load as collectives, through a strategy); these tools never take part in a run. They only read
and write the format the layer defines, so they import the layer's surface for backends (``protocol``,
``format``, ``checksums``, ``storage``, ``sources``, ``dcp``: the ``checkpoint-backends`` contract) and
nothing of its inner workings.

Where it sits in the layers (``pyproject.toml``): above ``phalanx.checkpoint``, whose format it reads, and
beside ``phalanx.strategies``, which it never needs (and which never needs it); below ``phalanx.fabric``
(which reads a saved state's counters with ``summary.counters``) and ``phalanx.cli`` (the ``phalanx ckpt``
commands).
"""
