"""``phalanx.Fabric`` and what it hands back: the facade over a strategy (``fabric``), the wrapped
module and optimizer (``wrappers``), distributed dataloaders (``data``), the meaning of its collectives
(``collectives``), non-finite checks (``anomaly``), ``torch.compile``d modules at setup (``compiled``), and
Lightning's ``throughput``, ``accelerators`` and ``plugins`` names (re-exported for users by the facades).
Users import ``phalanx.Fabric`` and ``phalanx.is_wrapped`` from the root package, their one public path."""
