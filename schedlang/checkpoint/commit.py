"""A checkpoint becomes visible only when it is complete: it is written under a staging name and renamed.

Every rank writes its shards into ``<path>.partial/``. Once every rank has finished (DCP's coordinator
writes ``.metadata`` only after gathering every rank's write results), rank 0 writes the small files it
was given (the trainer's state), then ``manifest.json`` (every file of the checkpoint with its size, and
a digest of ``.metadata``), and renames the directory to ``<path>``. A save cut off at any point (a
killed rank, a full disk, a lost node) leaves only the ``.partial`` directory, which no reader takes
for a checkpoint and the next save of the same path replaces.

"Complete" is checked cheaply when loading: one ``stat`` per file against the manifest, and a digest
of ``.metadata`` alone (it decides which bytes are read where; it is a few MB even for a large model).
The data files themselves are not hashed: that would read the whole checkpoint once more at every
save and load. A data file damaged in place while keeping its size is caught when DCP reads it
(``load_checkpoint`` then raises and leaves the model unchanged).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from typing import Dict, Mapping, Optional, Union

logger = logging.getLogger("schedlang.checkpoint")

MANIFEST = "manifest.json"
#: the suffix of a checkpoint being written; never loaded
STAGING_SUFFIX = ".partial"
#: the suffix a checkpoint saved over takes while its replacement is renamed into place
_REPLACED_SUFFIX = ".replaced"
MANIFEST_FORMAT = 1


def staging_path(path: str) -> str:
    """Where the checkpoint ``path`` is written before it is complete."""
    return os.fspath(path).rstrip(os.sep) + STAGING_SUFFIX


def replaced_path(path: str) -> str:
    """Where a checkpoint being saved over waits while its replacement is renamed into place."""
    return os.fspath(path).rstrip(os.sep) + _REPLACED_SUFFIX


def recover_replaced(path: str) -> None:
    """Undo what a save over ``path`` cut off between its two renames left: the old checkpoint renamed aside and
    the new one not yet in place. The old one comes back; once the new one is in place, the old one goes."""
    replaced = replaced_path(path)
    if not os.path.isdir(replaced):
        return
    if os.path.lexists(path):
        _remove(replaced)
    else:
        logger.warning("restoring %s from %s: a save over it was cut off before the new one was in place", path,
                       replaced)
        os.replace(replaced, path)


def clear_staging(path: str) -> str:
    """Remove what an interrupted save of ``path`` left behind and make an empty staging directory (rank 0)."""
    recover_replaced(path)
    staging = staging_path(path)
    if os.path.lexists(staging):
        logger.info("removing %s, left by a save of %s that did not finish", staging, path)
        _remove(staging)
    os.makedirs(staging)
    return staging


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def _sha256(file: str) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_synced(file: str, data: bytes) -> None:
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable (a crash of the machine right after it keeps it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - a file system without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def commit(path: str, step: Optional[int] = None, files: Optional[Mapping[str, Union[str, bytes]]] = None) -> None:
    """Finish the checkpoint staged for ``path`` and make it visible (rank 0, after every rank wrote its shards).

    ``files`` (name -> contents) are written beside the shards first; the manifest is written last,
    then the directory is renamed. A checkpoint already at ``path`` is replaced: it is renamed aside,
    the new one renamed into place, and the old one removed, so at no moment does ``path`` hold a mix.
    """
    path = os.fspath(path).rstrip(os.sep)
    staging = staging_path(path)
    for name, contents in (files or {}).items():
        _write_synced(os.path.join(staging, name), contents.encode() if isinstance(contents, str) else contents)
    sizes: Dict[str, int] = {}
    for root, _, names in os.walk(staging):
        for name in names:
            full = os.path.join(root, name)
            sizes[os.path.relpath(full, staging)] = os.path.getsize(full)
    manifest = {"format": MANIFEST_FORMAT, "step": step, "files": dict(sorted(sizes.items()))}
    if ".metadata" in sizes:
        manifest["metadata_sha256"] = _sha256(os.path.join(staging, ".metadata"))
    _write_synced(os.path.join(staging, MANIFEST), (json.dumps(manifest, indent=1) + "\n").encode())
    _sync_directory(staging)
    replaced = None
    if os.path.lexists(path):
        # a kill between this rename and the next leaves no checkpoint at ``path``: recover_replaced (the next
        # save of this path, or the trainer's resume) puts the old one back
        replaced = replaced_path(path)
        if os.path.lexists(replaced):
            _remove(replaced)
        os.replace(path, replaced)
    os.replace(staging, path)
    _sync_directory(os.path.dirname(os.path.abspath(path)))
    if replaced is not None:
        _remove(replaced)


def manifest_problem(path: str) -> Optional[str]:
    """Why the checkpoint ``path`` does not match its manifest (a file missing, of another size, a changed
    ``.metadata``), or None when it does or when it has no manifest (written by an older schedlang, or by
    DCP directly)."""
    file = os.path.join(path, MANIFEST)
    if not os.path.isfile(file):
        return None
    try:
        manifest = json.loads(open(file, encoding="utf-8").read())
        files = manifest["files"]
        if not isinstance(files, dict) or not all(isinstance(v, int) for v in files.values()):
            raise ValueError("'files' must map names to sizes")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {MANIFEST} cannot be read ({type(e).__name__}: {e})"
    problems = []
    for name, size in files.items():
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            problems.append(f"{name} is missing")
        elif os.path.getsize(full) != size:
            problems.append(f"{name} has {os.path.getsize(full)} bytes, the manifest says {size}")
    digest = manifest.get("metadata_sha256")
    if not problems and isinstance(digest, str) and _sha256(os.path.join(path, ".metadata")) != digest:
        problems.append(".metadata differs from the one the manifest records (its digest changed)")
    return "; ".join(problems) if problems else None
