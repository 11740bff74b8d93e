"""Processes and their agreement: starting jobs (``launch``), resolving devices (``accelerator``), the
lockstep guard that makes a collective reached by a subset of ranks fail fast (``lockstep``), and the
watchdog thread that ends a rank whose peers are gone or frozen (``watchdog``), with the records ranks
publish to each other (``heartbeat``) and the call sites they report (``callsites``), and one outcome on
every rank for a step that may fail on one (``outcome``). Built on
``torch.distributed`` and ``torch.distributed.run`` only; nothing here knows about models or strategies."""
