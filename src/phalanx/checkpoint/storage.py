"""Putting checkpoint bytes on disk so that no crash, full disk or read-only mount loses the previous one.

Every checkpoint phalanx writes, a file or a directory, appears at its path in one atomic step:

* a file is written to a hidden ``.<name>.tmp-<token>`` next to the target, fsynced, and renamed
  over the target (``os.replace`` is atomic on POSIX);
* a directory is assembled as ``.<name>.partial-<token>`` and swapped with the previous checkpoint in
  one ``renameat2(RENAME_EXCHANGE)`` where the OS has it. Elsewhere it takes two renames, and a crash
  between them leaves the previous checkpoint as ``.<name>.old-<token>`` with nothing at the path:
  :func:`locate` finds it there, so a load (or ``ckpt_path="last"``) gets the previous checkpoint.

A write that fails (no space left, a read-only mount, no permission) raises a ``CheckpointError``
naming the path and the operating system's cause, and leaves the previous checkpoint as it was.
Removal renames the checkpoint to a hidden ``.deleted-`` name first, so a crash mid-delete never
leaves a half-deleted directory that looks like a checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from phalanx.utils.errors import CheckpointError

_TMP = ".tmp-"
_PARTIAL = ".partial-"
_OLD = ".old-"
_DELETED = ".deleted-"
#: Leftovers of interrupted saves older than this are removed by the next save of the same target
#: (younger ones may belong to a save still running in another job).
STALE_SECONDS = 3600.0


def _hidden(path: Path, mark: str, token: str | None = None) -> Path:
    return path.with_name(f".{path.name}{mark}{token or uuid.uuid4().hex[:10]}")


def partial_dir(path: Path, token: str) -> Path:
    """The hidden directory a directory checkpoint of ``path`` is assembled in."""
    return _hidden(path, _PARTIAL, token)


def fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def delete_now(path: Path) -> None:
    """Delete a file or directory tree, ignoring what is already gone."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def clear_stale(path: Path) -> None:
    """Leftovers of killed saves and deletes of ``path``: invisible to load, but they take disk space."""
    now = time.time()
    for mark, older_than in ((_TMP, STALE_SECONDS), (_PARTIAL, STALE_SECONDS), (_DELETED, 0.0)):
        for stale in path.parent.glob(f".{path.name}{mark}*"):
            with contextlib.suppress(OSError):
                if now - stale.lstat().st_mtime >= older_than:
                    delete_now(stale)


def locate(path: Path) -> tuple[Path, bool] | None:
    """Where the checkpoint of ``path`` is: ``(path, False)``, or ``(previous, True)`` when a publish
    was interrupted between its two renames and only the previous checkpoint exists; None if neither."""
    if os.path.lexists(path):
        return path, False
    olds = sorted(path.parent.glob(f".{path.name}{_OLD}*"), key=lambda p: p.lstat().st_mtime)
    return (olds[-1], True) if olds else None


# ---------------------------------------------------------------------- failures with their true cause
def os_error_in(err: BaseException) -> OSError | None:
    """The operating-system error behind ``err``: torch reports a failed write as "enforce fail at
    inline_container.cc ... unexpected pos" and keeps the real ``OSError`` only as its context."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [err]
    while stack:
        item = stack.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, OSError):
            return item
        stack += [item.__cause__, item.__context__]
        failures = getattr(item, "failures", None)  # torch.distributed.checkpoint: one error per rank
        if isinstance(failures, dict):  # values: (exception, traceback summary)
            stack += [f[0] if isinstance(f, tuple) and f else None for f in failures.values()]
    return None


def probe_write(directory: Path, size: int = 2**20) -> OSError | None:
    """The error the operating system gives for a test write of ``size`` bytes in ``directory`` (None if
    it succeeds). Some writers lose the real ``OSError`` on the way (torch.distributed.checkpoint
    pickles each rank's exception to share it, which drops its context); asking the filesystem again
    recovers the true cause."""
    probe = directory / f".phalanx-probe-{uuid.uuid4().hex[:10]}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
    except OSError as err:
        return OSError(err.errno, err.strerror, str(directory))
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except (AttributeError, OSError) as err:  # no fallocate here (platform or filesystem): write zeros
            if isinstance(err, OSError) and err.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            os.write(fd, bytes(size))
        os.fsync(fd)
    except OSError as err:
        return OSError(err.errno, err.strerror, str(directory))
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)
    return None


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def write_error(err: BaseException, path: Path, action: str, needed: int | None = None) -> CheckpointError:
    """A ``CheckpointError`` that names ``path`` and the true cause of a failed write (``action``: what
    was attempted, e.g. "write checkpoint")."""
    os_err = os_error_in(err)
    if os_err is None and not isinstance(err, CheckpointError):
        os_err = probe_write(path.parent if path.parent.exists() else Path.cwd())
    if os_err is None:
        return err if isinstance(err, CheckpointError) else CheckpointError(
            f"Cannot {action} {path}: {type(err).__name__}: {err}. The previous checkpoint, if any, is unchanged."
        )
    cause = os_err.strerror or str(os_err)
    where = os_err.filename or path
    detail = ""
    if os_err.errno in (errno.ENOSPC, errno.EDQUOT):
        free = None
        with contextlib.suppress(OSError):
            st = os.statvfs(path.parent if path.parent.exists() else Path.cwd())
            free = st.f_bavail * st.f_frsize
        need = f"it needs about {_mib(needed)}" if needed else "it did not fit"
        have = f", {_mib(free)} free there" if free is not None else ""
        detail = f" ({need}{have}). Free some space or save to another filesystem"
    elif os_err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        detail = f". Save to a writable directory (this process cannot write to {path.parent})"
    return CheckpointError(
        f"Cannot {action} {path}: [Errno {os_err.errno}] {cause}: {str(where)!r}{detail}. "
        "The previous checkpoint, if any, is unchanged."
    )


# ---------------------------------------------------------------------- files
def _expected_size(obj: Any, previous: Path) -> int:
    """Bytes the checkpoint will take: the previous file's size, else the sum of its tensor storages."""
    with contextlib.suppress(OSError):
        return previous.stat().st_size
    seen: dict[int, int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.device.type != "meta":
                storage = item.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(v for v in item if isinstance(v, (torch.Tensor, dict, list, tuple)))
    return sum(seen.values())


def _preallocate(fh: Any, size: int) -> bool:
    """Reserve the file's blocks up front. Writing a large checkpoint into a fresh file otherwise
    allocates its extents piecemeal, slower than overwriting a file in place; preallocated, the atomic
    write costs what an in-place one does (bench/checkpoint.py measures both)."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None or size < 2**20:
        return False
    try:
        fallocate(fh.fileno(), 0, size)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            # The estimate can exceed the real size (a previous, larger file): let the write itself
            # decide, it reports a real shortage with its true cause.
            with contextlib.suppress(OSError):
                fh.truncate(0)
        return False  # or unsupported on this filesystem
    return True


def write_file(obj: Any, path: Path, what: str = "checkpoint", replace_dir: bool = False) -> None:
    """``torch.save(obj, path)`` that is all-or-nothing and reports why it failed. With ``replace_dir``
    a directory at ``path`` (a checkpoint of the directory layout, as the caller checked) is replaced as
    atomically as :func:`publish_dir` replaces one."""
    path = Path(path)
    if path.is_dir() and not replace_dir:
        raise CheckpointError(
            f"Cannot write {what} file {path}: a directory exists at that path (a sharded checkpoint?). "
            "Choose another path or remove it first."
        )
    needed = None
    tmp = _hidden(path, _TMP)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        clear_stale(path)
        needed = _expected_size(obj, path)
        with open(tmp, "wb") as fh:
            reserved = _preallocate(fh, needed)
            torch.save(obj, fh)
            fh.flush()
            if reserved:
                fh.truncate(fh.tell())  # give back what the estimate reserved beyond the data
            os.fsync(fh.fileno())
        if path.is_dir() and not path.is_symlink():
            _move_into_place(tmp, path, exchange=True)  # os.replace cannot put a file over a directory
        else:
            os.replace(tmp, path)
    except Exception as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise write_error(err, path, f"write {what}", needed) from err
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)
    for old in path.parent.glob(f".{path.name}{_OLD}*"):
        delete_now(old)  # the previous checkpoint of the directory layout, kept while it was replaced


# ---------------------------------------------------------------------- directories
def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # only directory checkpoints need it; keeps `import phalanx` light

    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish_dir(tmp: Path, path: Path, exchange: bool = True, replace_file: bool = False) -> None:
    """Move the finished directory ``tmp`` to ``path``, replacing what is there; ``path`` holds a
    complete checkpoint (the old or the new one) at every instant, or, on systems without an atomic
    exchange, the old one sits under ``.old-`` for the moment between two renames. A file at ``path``
    is replaced the same way only with ``replace_file`` (the caller checked it is a checkpoint). A
    failure is a ``CheckpointError`` naming its true cause."""
    if os.path.lexists(path) and not path.is_dir() and not replace_file:
        raise CheckpointError(
            f"Cannot write the checkpoint directory {path}: a file exists at that path (a single-file "
            "checkpoint?). Choose another path or remove it first."
        )
    fsync_dir(tmp)  # its entries are durable before the directory appears under its name
    try:
        _move_into_place(tmp, path, exchange)
    except OSError as err:
        raise write_error(err, path, "publish checkpoint") from err
    fsync_dir(path.parent)
    for old in path.parent.glob(f".{path.name}{_OLD}*"):
        delete_now(old)  # the new checkpoint is in place: older copies are garbage now


def _move_into_place(tmp: Path, path: Path, exchange: bool) -> None:
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif exchange and _exchange(tmp, path):
        # `tmp` now holds the previous checkpoint. Deleting hundreds of MiB takes a while and nobody
        # waits for it; if the process dies first, it stays hidden and a later save clears it.
        threading.Thread(target=delete_now, args=(tmp,), name="phalanx-ckpt-cleanup", daemon=True).start()
    else:
        old = _hidden(path, _OLD)
        os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(old, path)
            raise


def remove(path: Path) -> None:
    """Delete the checkpoint at ``path`` (file or directory, and an interrupted publish's ``.old-``)."""
    targets = [p for p in (path, *path.parent.glob(f".{path.name}{_OLD}*")) if os.path.lexists(p)]
    for target in targets:
        hidden = _hidden(path, _DELETED)
        try:
            os.rename(target, hidden)
        except OSError as err:
            raise write_error(err, path, "remove checkpoint") from err
        delete_now(hidden)
    if targets:
        fsync_dir(path.parent)
