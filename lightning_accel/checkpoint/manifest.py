"""What a checkpoint folder held when it was saved: ``checkpoint_manifest.json``, the size and sha256 of every file.

``save_state`` writes it last, inside the temporary folder, just before the folder is published; ``load_state``
checks it before reading anything, so a truncated file, a flipped bit or a file replaced since the save is an error
naming the file and what differs, not a silent load of other numbers. A folder without a manifest (HF accelerate's,
an older one of ours) loads as before. Files added to the folder after the save (a process's random states handed
in once the folder was published, a user's own files in an ``output_dir``) are not listed and not checked.

Hashing reads every file once more; the files are hashed on a few threads (``hashlib`` releases the GIL), so on a
machine with several cores the cost is about that of the largest file. ``benchmarks/checkpoint.py`` measures it: on
the 705 MB state about as long again as writing it into the page cache. ``save_state(checksums=False)`` records the
sizes only; an asynchronous save hashes in its background thread, where it blocks nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lightning_accel.utils.other import writing

__all__ = ["MANIFEST_NAME", "CheckpointIntegrityError", "verify_manifest", "write_manifest"]

MANIFEST_NAME = "checkpoint_manifest.json"
_FORMAT = 1
_CHUNK = 8 << 20


class CheckpointIntegrityError(ValueError):
    """A checkpoint file differs from what its folder's manifest records."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        while read := file.readinto(buffer):
            digest.update(view[:read])
    return digest.hexdigest()


def _files(folder: Path) -> list[str]:
    return sorted(
        entry.relative_to(folder).as_posix()
        for entry in folder.rglob("*")
        if entry.is_file() and entry.name != MANIFEST_NAME
    )


def _hash_all(folder: Path, names: list[str]) -> list[str]:
    workers = max(1, min(4, os.cpu_count() or 1, len(names)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="checkpoint-sha256") as pool:
        return list(pool.map(lambda name: _sha256(folder / name), names))


def write_manifest(folder: Path, *, checksums: bool = True) -> None:
    """Record the size and sha256 of every file under ``folder`` in its ``checkpoint_manifest.json``.

    Args:
        folder: The checkpoint folder, complete.
        checksums: Hash the files; ``False`` records their sizes only (a truncated file is still found, a flipped bit
            is not), which saves reading every file once more.

    """
    names = _files(folder)
    digests: list[str | None] = list(_hash_all(folder, names)) if checksums else [None] * len(names)
    entries: dict[str, dict[str, int | str | None]] = {
        name: {"size": (folder / name).stat().st_size, "sha256": digest}
        for name, digest in zip(names, digests, strict=True)
    }
    target = folder / MANIFEST_NAME
    with writing(target):
        target.write_text(json.dumps({"format": _FORMAT, "files": entries}, indent=1))


def verify_manifest(folder: Path) -> bool:
    """Check every file ``folder``'s manifest lists against its recorded size and sha256.

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
        f"{name} has {size} bytes, {entries[name]['size']} when saved (truncated or rewritten)"
        for name, size in sizes.items()
        if size != entries[name]["size"]
    ]
    whole = [name for name, size in sizes.items() if size == entries[name]["size"] and entries[name]["sha256"]]
    problems += [
        f"{name} has other contents than when saved (a flipped bit or an overwrite: sha256 {digest[:12]}...,"
        f" {str(entries[name]['sha256'])[:12]}... when saved)"
        for name, digest in zip(whole, _hash_all(folder, whole), strict=True)
        if digest != entries[name]["sha256"]
    ]
    if problems:
        raise CheckpointIntegrityError(
            f"The checkpoint {folder} is not what was saved: {'; '.join(problems)}. Load another checkpoint (an"
            f" older checkpoint_<i>), or delete {MANIFEST_NAME} to load the files as they are."
        )
    return True


def _read_entries(manifest: Path) -> dict[str, dict[str, int | str | None]]:
    try:
        recorded = json.loads(manifest.read_text())
        entries = recorded["files"]
        for name, entry in entries.items():
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise ValueError(f"the entry {name!r} points outside the folder")
            if not (isinstance(entry["size"], int) and isinstance(entry["sha256"], (str, type(None)))):
                raise ValueError(f"the entry {name!r} has no size and sha256 (or null)")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointIntegrityError(f"Could not read the checkpoint manifest {manifest}: {error}") from error
    return entries
