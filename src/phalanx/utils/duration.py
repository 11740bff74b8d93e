"""Reading a time budget in Lightning's formats (``Trainer(max_time=...)``, ``Timer(duration=...)``).

It lives at the bottom layer because both the Trainer's settings and the Timer callback (a layer
below the Trainer) read the same formats; one parser keeps them from drifting apart.
"""

from __future__ import annotations

import datetime
from typing import Any

from phalanx.utils.errors import MisconfigurationError


def parse_duration(value: Any, name: str) -> datetime.timedelta:
    """``"DD:HH:MM:SS"``, a ``timedelta`` or a dict of timedelta fields (Lightning's formats)."""
    if isinstance(value, datetime.timedelta):
        return value
    if isinstance(value, dict):
        try:
            return datetime.timedelta(**value)
        except TypeError as err:
            raise MisconfigurationError(f"{name}={value!r}: the keys must be timedelta fields ({err}).") from err
    if isinstance(value, str):
        parts = value.split(":")
        if len(parts) == 4 and all(p.strip().isdigit() for p in parts):
            d, h, m, s = (int(p) for p in parts)
            return datetime.timedelta(days=d, hours=h, minutes=m, seconds=s)
    raise MisconfigurationError(
        f"{name}={value!r}: use 'DD:HH:MM:SS', a datetime.timedelta or a dict such as {{'hours': 2}}."
    )
