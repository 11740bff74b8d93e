"""String names of the strategies whose modules are imported only when asked for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

FACTORIES: dict[str, Callable[[], Any]] = {}
