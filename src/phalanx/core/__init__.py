"""The user's code as the Trainer sees it: ``Module`` (:mod:`phalanx.core.module`) and ``DataModule``
(:mod:`phalanx.core.datamodule`) with Lightning's hooks, ``save_hyperparameters``, loading from checkpoints,
and snapshots of everything a module holds. Code here talks to a Trainer only through the
:class:`~phalanx.core.view.TrainerView` protocol. Users import ``phalanx.Module`` / ``phalanx.LightningModule``
(and the DataModule's two names) from the root package, their one public path."""
