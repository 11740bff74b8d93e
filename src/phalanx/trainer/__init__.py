"""The managed training loop, ``phalanx.Trainer`` (defined in :mod:`phalanx.trainer.trainer`; users import it
from the root package, its one public path)."""
