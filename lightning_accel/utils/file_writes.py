"""Writing checkpoint files so that a failed write names the file, its folder and the cause.

torch's own writer turns a full disk or a file over the size limit into ``unexpected pos 19712 vs 19600``, and
safetensors into ``I/O error ... (os error 28)``. :func:`torch_save` and :func:`safetensors_save` write through a file
this package opens, so the operating system's error reaches us, and :func:`writing` turns it into a
:class:`CheckpointWriteError`: an ``OSError`` with the same ``errno`` whose message names the file, the folder, the
cause (``ENOSPC``, ``EFBIG``, ``EDQUOT``) and what to do. Where a writer we do not control failed (DeepSpeed's and
DCP's files), :func:`write_error` finds the cause from the machine (free space, the process's file size limit) and the
file from the folder (the one written last).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

__all__ = ["CheckpointWriteError", "safetensors_save", "torch_save", "write_error", "writing"]

_CAUSES = {
    errno.ENOSPC: "the disk is full",
    errno.EFBIG: "the file grew past the largest file this process may write",
    errno.EDQUOT: "the disk quota is exhausted",
}
_RUST_OS_ERROR = re.compile(r"os error (\d+)")
_NEARLY_FULL = 1 << 20  # bytes left on a disk that a failed write filled


class CheckpointWriteError(OSError):
    """A checkpoint file could not be written: ``errno`` is the operating system's, ``path`` the file.

    Args:
        code: ``errno.ENOSPC``, ``errno.EFBIG`` or ``errno.EDQUOT``.
        path: The file being written.

    """

    def __init__(self, code: int, path: Path) -> None:
        self.code, self.path = code, path
        super().__init__(code, _message(code, path))

    def __reduce__(self) -> tuple[type[CheckpointWriteError], tuple[int, Path]]:  # crosses process boundaries
        return type(self), (self.code, self.path)

    def __str__(self) -> str:
        return str(self.strerror)


def _message(code: int, path: Path) -> str:
    folder = path.parent
    name = errno.errorcode.get(code, str(code))
    hint = {
        errno.ENOSPC: f"free space on that disk ({_free_bytes(folder)} bytes free now) or save elsewhere",
        errno.EFBIG: f"raise the limit ({_size_limit()}) or save smaller files (max_shard_size)",
        errno.EDQUOT: "free space within your quota or save elsewhere",
    }[code]
    return f"Could not write {path.name} in the folder {folder}: {_CAUSES[code]} ({name}); {hint}."


def _free_bytes(folder: Path) -> int | str:
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return "unknown"


def _size_limit() -> str:
    soft = _file_size_limit()
    return "the filesystem's largest file" if soft is None else f"ulimit -f: {soft} bytes for this process"


def _file_size_limit() -> int | None:
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def _os_error_code(error: BaseException) -> int | None:
    """The ``errno`` of a full disk, file size limit or quota anywhere in ``error``'s chain of causes."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _CAUSES:
            return current.errno
        if (match := _RUST_OS_ERROR.search(str(current))) and int(match[1]) in _CAUSES:
            return int(match[1])
        current = current.__cause__ or current.__context__
    return None


def _cause_from_machine(path: Path) -> int | None:
    """Why writing ``path`` failed when the error does not say: a full disk, or the file at the size limit."""
    if isinstance(free := _free_bytes(path.parent), int) and free < _NEARLY_FULL:
        return errno.ENOSPC
    limit = _file_size_limit()
    if limit is not None and path.is_file() and path.stat().st_size >= limit:
        return errno.EFBIG
    return None


def _newest_file(folder: Path) -> Path | None:
    files = [entry for entry in folder.rglob("*") if entry.is_file()] if folder.is_dir() else []
    return max(files, key=lambda entry: entry.stat().st_mtime_ns, default=None)


def write_error(error: BaseException, folder: Path, path: Path | None = None) -> CheckpointWriteError | None:
    """The :class:`CheckpointWriteError` that ``error``, raised while writing into ``folder``, amounts to.

    Args:
        error: What the writer raised.
        folder: The folder being written.
        path: The file being written, where known; else the file of ``folder`` written last.

    Returns:
        ``None`` when ``error`` is no full disk, file size limit or quota (nor its cause): raise it as it is.

    """
    if isinstance(error, CheckpointWriteError):
        return error
    target = path or _newest_file(folder) or folder
    code = _os_error_code(error)
    if code is None:
        code = _cause_from_machine(target)
    return None if code is None else CheckpointWriteError(code, target)


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Raise a full disk, a file size limit or a quota met while writing ``path`` as :class:`CheckpointWriteError`."""
    try:
        yield
    except Exception as error:
        named = write_error(error, path.parent, path)
        if named is None or named is error:
            raise
        raise named from error


def torch_save(obj: object, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)``, a failure named by :func:`writing`."""
    target = Path(path)
    with writing(target), open(target, "wb") as file:
        torch.save(obj, file)


def safetensors_save(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str]) -> None:
    """Write ``tensors`` as a safetensors file (metadata ``{"format": "pt"}``), a failure named by :func:`writing`."""
    from safetensors.torch import save_file

    target = Path(path)
    with writing(target):
        save_file(dict(tensors), os.fspath(target), metadata={"format": "pt"})
