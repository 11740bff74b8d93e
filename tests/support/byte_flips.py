"""Damaging checkpoint files on purpose (tests/checkpoint/test_checksums.py and its sharded job)."""

from __future__ import annotations

from pathlib import Path


def flip(path: Path, raw: bytes, count: int = 64, at: int = 256) -> tuple[bytes, bytes]:
    """Invert ``count`` bytes inside the only copy of ``raw`` (a tensor's bytes) in ``path``: certain to hit
    tensor data, not a zip header. Returns the bytes before and after."""
    data = bytearray(path.read_bytes())
    start = data.find(raw)
    assert start >= 0 and data.find(raw, start + 1) == -1, "the tensor's bytes must occur exactly once"
    assert at + count <= len(raw)
    for i in range(start + at, start + at + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    return raw, bytes(data[start:start + len(raw)])
