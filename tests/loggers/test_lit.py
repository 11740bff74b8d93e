"""``LitLogger`` imports (a ported program starts) and its constructor names the loggers to use instead."""

from __future__ import annotations

import pytest

from phalanx.loggers import LitLogger
from phalanx.utils.errors import MisconfigurationError


def test_lit_logger_refuses_with_alternatives() -> None:
    with pytest.raises(MisconfigurationError, match=r"phalanx uploads nothing\. Use CSVLogger or TensorBoardLogger.*"
                                                     r"WandbLogger / MLFlowLogger"):
        LitLogger(root_dir="logs", name="run", teamspace="team")
