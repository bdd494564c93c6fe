"""What a checkpoint folder held when it was saved: ``checkpoint_manifest.json``, the size and checksum of every file.

``save_state`` writes it last, inside the temporary folder, just before the folder is published; ``load_state``
checks it before reading anything, so a truncated file, a flipped bit or a file replaced since the save is an error
naming the file and what differs, not a silent load of other numbers. A folder without a manifest (HF accelerate's,
an older one of ours) loads as before. Files added to the folder after the save (a process's random states handed
in once the folder was published, a user's own files in an ``output_dir``) are not listed and not checked.

The checksum is CRC-32 unless the save asks for ``sha256`` (or for none: sizes only). The manifest guards against
corruption (a torn write, a bit flipped on disk or in transit), not against someone who can rewrite the folder, who
could rewrite the manifest too; for that purpose CRC-32 finds every flipped bit and every burst of up to 32 bits, as
sha256 does, at about twice its speed. ``sha256`` gives digests that ``sha256sum`` reproduces.

The files are checksummed as they are written: :class:`Checksums` is the
:class:`~lightning_accel.utils.other.WriteObserver` of a save, so the bytes ``torch.save`` writes go through the
hasher on a second thread while the write goes on (``zlib`` and ``hashlib`` release the GIL), and a file a library
writes itself (safetensors) is read back on that thread while the next file is written. A file written otherwise (an
engine's shards, another process's random states) is read back when the manifest is written.
``benchmarks/checkpoint.py`` measures the cost.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, Literal, Protocol, cast, get_args

from typing_extensions import override

from lightning_accel.utils.other import writing

__all__ = [
    "MANIFEST_NAME",
    "CheckpointIntegrityError",
    "ChecksumName",
    "Checksums",
    "verify_manifest",
    "write_manifest",
]

MANIFEST_NAME = "checkpoint_manifest.json"
ChecksumName = Literal["crc32", "sha256"]
_FORMAT = 1
_CHUNK = 8 << 20
_ON_THE_SIDE = 1 << 20  # a write at least this large is hashed on the pool's thread while it is written


class CheckpointIntegrityError(ValueError):
    """A checkpoint file differs from what its folder's manifest records."""


class _Hasher(Protocol):
    def update(self, data: memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    """``zlib.crc32`` behind ``hashlib``'s ``update``/``hexdigest``."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: memoryview, /) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


_HASHERS: dict[str, Callable[[], _Hasher]] = {"crc32": _Crc32, "sha256": hashlib.sha256}


def _hash_file(path: Path, algorithm: str) -> str:
    digest = _HASHERS[algorithm]()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        while read := file.readinto(buffer):
            digest.update(view[:read])
    return digest.hexdigest()


def _stamp(path: Path) -> tuple[int, int]:
    status = path.stat()
    return status.st_size, status.st_mtime_ns


class _Tee(io.RawIOBase):
    """A file that passes every write to ``file`` and to a hasher, large ones hashed on ``pool`` meanwhile."""

    def __init__(self, file: BinaryIO, hasher: _Hasher, pool: ThreadPoolExecutor) -> None:
        super().__init__()
        self._file, self._hasher, self._pool = file, hasher, pool

    @override
    def writable(self) -> bool:
        return True

    @override
    def write(self, data: object, /) -> int:
        view = memoryview(cast("bytes", data))
        if view.nbytes < _ON_THE_SIDE:
            self._hasher.update(view)
            return self._file.write(view)
        hashed = self._pool.submit(self._hasher.update, view)  # the caller may reuse the buffer once we return
        try:
            return self._file.write(view)
        finally:
            hashed.result()

    @override
    def flush(self) -> None:
        self._file.flush()


class Checksums:
    """The checksums of one save's files: taken while the package's writers write them, else read back.

    Use it as the save's :class:`~lightning_accel.utils.other.WriteObserver` (``observing_writes(checksums)``), then
    hand it to :func:`write_manifest`.

    Args:
        algorithm: ``"crc32"``, ``"sha256"``, or ``None`` to record sizes only (a truncated file is still found, a
            flipped bit is not).

    Raises:
        ValueError: For another ``algorithm``.

    """

    def __init__(self, algorithm: ChecksumName | None = "crc32") -> None:
        if algorithm is not None and algorithm not in get_args(ChecksumName):
            raise ValueError(
                f"checksum={algorithm!r} is not a checksum this package writes: use 'crc32' (the default), 'sha256'"
                " or None (sizes only)."
            )
        self.algorithm = algorithm
        self._pool: ThreadPoolExecutor | None = None
        self._streams: dict[Path, _Hasher] = {}
        self._known: dict[Path, tuple[tuple[int, int], Future[str]]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, object]:
        """The algorithm alone: a pickled ``Accelerator`` carries no thread, lock or pending checksum."""
        return {"algorithm": self.algorithm}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(cast("ChecksumName | None", state["algorithm"]))  # type: ignore[misc]

    def _threads(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="checkpoint-checksum")
            return self._pool

    def stream(self, path: Path, file: BinaryIO) -> BinaryIO:
        """``file``, with what is written to it checksummed on the way (see :class:`WriteObserver`)."""
        if self.algorithm is None:
            return file
        hasher = self._streams[path.resolve()] = _HASHERS[self.algorithm]()
        return cast("BinaryIO", _Tee(file, hasher, self._threads()))

    def written(self, path: Path) -> None:
        """Record ``path``'s checksum: the streamed one, or a read-back started now on the pool's thread."""
        if self.algorithm is None:
            return
        key = path.resolve()
        stamp = _stamp(key)
        hasher = self._streams.pop(key, None)
        if hasher is not None:
            done: Future[str] = Future()
            done.set_result(hasher.hexdigest())
            self._known[key] = (stamp, done)
        else:
            self._known[key] = (stamp, self._threads().submit(_hash_file, key, self.algorithm))

    def digests(self, folder: Path, names: list[str]) -> list[str | None]:
        """The checksum of each of ``folder``'s ``names``: the recorded one where the file is unchanged since."""
        if self.algorithm is None:
            return [None] * len(names)
        algorithm = self.algorithm
        futures: list[Future[str]] = []
        with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as rest:
            for name in names:
                path = (folder / name).resolve()
                known = self._known.get(path)
                fresh = known is not None and known[0] == _stamp(path)
                futures.append(known[1] if known is not None and fresh else rest.submit(_hash_file, path, algorithm))
            return [future.result() for future in futures]


def _files(folder: Path) -> list[str]:
    return sorted(
        entry.relative_to(folder).as_posix()
        for entry in folder.rglob("*")
        if entry.is_file() and entry.name != MANIFEST_NAME
    )


def write_manifest(folder: Path, checksums: Checksums | None = None) -> None:
    """Record the size and checksum of every file under ``folder`` in its ``checkpoint_manifest.json``.

    Args:
        folder: The checkpoint folder, complete.
        checksums: What the save's writers recorded, and the algorithm; ``None``: CRC-32, every file read back.

    """
    checksums = checksums or Checksums()
    names = _files(folder)
    algorithm = checksums.algorithm
    entries: dict[str, dict[str, int | str]] = {}
    for name, digest in zip(names, checksums.digests(folder, names), strict=True):
        entries[name] = {"size": (folder / name).stat().st_size}
        if algorithm is not None and digest is not None:
            entries[name][algorithm] = digest
    target = folder / MANIFEST_NAME
    with writing(target):
        target.write_text(json.dumps({"format": _FORMAT, "files": entries}, indent=1))


def verify_manifest(folder: Path) -> bool:
    """Check every file ``folder``'s manifest lists against its recorded size and checksum.

    Returns:
        Whether the folder had a manifest (``False``: nothing was checked).

    Raises:
        CheckpointIntegrityError: (a ``ValueError``) Naming each file that is missing, has another size or other
            contents than when it was saved, or for an unreadable manifest.

    """
    manifest = folder / MANIFEST_NAME
    if not manifest.is_file():
        return False
    entries = _read_entries(manifest)
    sizes = {name: (folder / name).stat().st_size for name in entries if (folder / name).is_file()}
    problems = [f"{name} is missing" for name in entries if name not in sizes]
    problems += [
        f"{name} has {size} bytes, {entries[name].size} when saved (truncated or rewritten)"
        for name, size in sizes.items()
        if size != entries[name].size
    ]
    whole = [name for name, size in sizes.items() if size == entries[name].size and entries[name].algorithm]
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        found = list(pool.map(lambda name: _hash_file(folder / name, str(entries[name].algorithm)), whole))
    problems += [
        f"{name} has other contents than when saved (a flipped bit or an overwrite: {entries[name].algorithm}"
        f" {digest[:12]}, {entries[name].digest[:12]} when saved)"
        for name, digest in zip(whole, found, strict=True)
        if digest != entries[name].digest
    ]
    if problems:
        raise CheckpointIntegrityError(
            f"The checkpoint {folder} is not what was saved: {'; '.join(problems)}. Load another checkpoint (an"
            f" older checkpoint_<i>), or delete {MANIFEST_NAME} to load the files as they are."
        )
    return True


class _Entry:
    """One file's line of a manifest: its size and, where recorded, its checksum and the checksum's algorithm."""

    def __init__(self, name: str, recorded: object) -> None:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"the entry {name!r} points outside the folder")
        if not isinstance(recorded, dict) or not isinstance(recorded.get("size"), int):
            raise ValueError(f"the entry {name!r} has no size")
        found = [(key, value) for key, value in recorded.items() if key in _HASHERS and value is not None]
        if len(found) > 1 or any(not isinstance(value, str) for _, value in found):
            raise ValueError(f"the entry {name!r} has no single checksum ({sorted(_HASHERS)} or none)")
        self.size: int = recorded["size"]
        self.algorithm: str | None = found[0][0] if found else None
        self.digest: str = str(found[0][1]) if found else ""


def _read_entries(manifest: Path) -> dict[str, _Entry]:
    try:
        recorded = json.loads(manifest.read_text())
        return {name: _Entry(name, entry) for name, entry in recorded["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointIntegrityError(f"Could not read the checkpoint manifest {manifest}: {error}") from error
