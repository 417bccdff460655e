"""The on-disk protocol of a checkpoint directory: manifest, checksums, atomic publish.

A checkpoint ``A`` is written under ``A.partial`` (marked by :data:`PARTIAL_MARKER` the
moment it is created), every file is fsync'ed and recorded in the manifest with its size
and xxh3-128 checksum, the manifest is written last, and the directory is published by
renaming ``A`` to ``A.old``, ``A.partial`` to ``A`` and removing ``A.old``. A crash at any
point leaves the previous complete checkpoint at ``A`` or at ``A.old``; the next save
finishes or undoes the interrupted one (:func:`recover_interrupted_save`) and ``load``
names where the checkpoint is (:func:`explain_missing`).

torchbay deletes only what it wrote: a directory is replaced or removed only when it is
empty, is a ``.partial`` carrying the marker, or holds a valid manifest and no file that
the manifest does not list; files are unlinked one by one from that list, never with
``rmtree`` on a path torchbay has not checked.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from torchbay.errors import CheckpointError
from torchbay.storage.files import fsync_dir, fsync_tree_dirs

log = logging.getLogger("torchbay")

MANIFEST = "torchbay_manifest.json"
PARTIAL_MARKER = ".torchbay_partial"
FORMAT_VERSION = 2
REQUIRED_FIELDS = ("format_version", "kind", "files")
KINDS = ("state", "model")
#: the folder names of automatic checkpoints (``ProjectConfiguration(automatic_checkpoint_naming=True)``)
AUTOMATIC_NAME = re.compile(r"checkpoint_(\d+)")


# --- the manifest -------------------------------------------------------------------------


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of ``directory``; one clear :class:`CheckpointError` for each way it can be wrong."""
    if directory.is_symlink() and not directory.exists():
        raise CheckpointError(f"{directory} is a broken symbolic link")
    if not directory.exists():
        raise CheckpointError(explain_missing(directory))
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is a file, not a checkpoint directory; pass the directory that "
                              f"save_state wrote")
    path = directory / MANIFEST
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, not a manifest file; {directory} is not a torchbay checkpoint")
    if not path.exists():
        hint = " (it is an interrupted save)" if directory.name.endswith(".partial") else ""
        raise CheckpointError(f"{directory} is not a complete torchbay checkpoint: {MANIFEST} is missing{hint}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); the checkpoint is damaged") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path} is not a torchbay manifest (a JSON object was expected)")
    missing = [f for f in REQUIRED_FIELDS if f not in manifest]
    if missing:
        raise CheckpointError(f"{path} lacks the required field(s) {', '.join(missing)}; it was not written by "
                              f"torchbay or is damaged")
    files = manifest["files"]
    if isinstance(files, list):  # format 1: names only, nothing to verify
        manifest["files"] = files = {name: {} for name in files}
    elif not isinstance(files, dict):
        raise CheckpointError(f"{path}: 'files' must map file names to their size and checksum")
    outside = [name for name in files if not _inside(name)]
    if outside:
        raise CheckpointError(f"{path} lists file(s) outside the checkpoint directory "
                              f"({', '.join(map(str, outside[:3]))}); "
                              f"torchbay neither reads nor removes them: the manifest is damaged or forged")
    return manifest


def _inside(name: Any) -> bool:
    """A manifest entry is a plain relative path below the checkpoint directory."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        return False
    parts = Path(name).parts
    return not Path(name).is_absolute() and ".." not in parts and "." not in parts and name == Path(name).as_posix()


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    path = directory / MANIFEST
    with open(path, "w", encoding="utf-8") as fp:
        json.dump(manifest, fp, indent=2)
        fp.flush()
        os.fsync(fp.fileno())


def _complete_manifest(directory: Path) -> dict[str, Any] | None:
    if directory.is_symlink() or not directory.is_dir():
        return None
    try:
        return read_manifest(directory)
    except CheckpointError:
        return None


def foreign_entries(directory: Path, manifest: dict[str, Any]) -> list[str]:
    """Files and links under ``directory`` that the manifest does not list (relative paths)."""
    listed = set(manifest["files"]) | {MANIFEST, PARTIAL_MARKER}
    listed_dirs = {parent.as_posix() for name in listed for parent in Path(name).parents}
    foreign = []
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory).as_posix()
        if path.is_symlink() or (rel not in listed_dirs if path.is_dir() else rel not in listed):
            foreign.append(rel)
    return foreign


# --- what may be replaced or removed ----------------------------------------------------------


def _protected_reason(path: Path) -> str | None:
    resolved = path.resolve()
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        return "it is the current directory or one of its parents"
    if resolved == Path.home().resolve():
        return "it is your home directory"
    if resolved == Path(resolved.anchor):
        return "it is the root of the file system"
    return None


def check_replaceable(final: Path, what: str = "save_state") -> None:
    """Raise unless ``final`` is absent, an empty directory or a complete torchbay checkpoint alone."""
    fix = f"{what} replaces the whole directory; pass a new or empty directory, or a torchbay checkpoint"
    if final.is_symlink():
        raise CheckpointError(f"{what}: {final} is a symbolic link; torchbay does not replace links. {fix}")
    reason = _protected_reason(final)
    if reason:
        raise CheckpointError(f"{what}: refusing to write to {final}: {reason}. {fix}")
    if not final.exists():
        return
    if not final.is_dir():
        raise CheckpointError(f"{what}: {final} is a file, not a directory; torchbay will not replace it. {fix}")
    entries = sorted(p.name for p in final.iterdir())
    if not entries:
        return
    manifest = _complete_manifest(final)
    if manifest is None:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise CheckpointError(f"{what}: {final} holds files that are not a torchbay checkpoint ({shown}); "
                              f"nothing was written. {fix}")
    foreign = foreign_entries(final, manifest)
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise CheckpointError(f"{what}: {final} holds a torchbay checkpoint and also files torchbay did not write "
                              f"({shown}); move them elsewhere or pick another directory. Nothing was written.")


def remove_own_checkpoint(directory: Path, why: str) -> None:
    """Delete a checkpoint torchbay wrote: only the files its manifest lists, then its empty dirs."""
    if directory.is_symlink() or not directory.is_dir():
        raise CheckpointError(f"will not remove {directory}: it is not a directory torchbay wrote")
    if not any(p.is_file() or p.is_symlink() for p in directory.rglob("*")):  # empty, or emptied before a crash
        _remove_empty_dirs(directory)
        return
    manifest = read_manifest(directory)
    foreign = foreign_entries(directory, manifest)
    if foreign:
        raise CheckpointError(f"will not remove {directory} ({why}): it holds files torchbay did not write "
                              f"({', '.join(foreign[:5])})")
    for name in [*manifest["files"], PARTIAL_MARKER, MANIFEST]:
        path = directory / name  # every name is inside the directory (read_manifest checks) and no link is (foreign)
        if path.is_file():
            path.unlink()
    _remove_empty_dirs(directory)
    log.debug("torchbay: removed %s (%s)", directory, why)


def _remove_empty_dirs(root: Path) -> None:
    for path in sorted((p for p in root.rglob("*") if p.is_dir() and not p.is_symlink()),
                       key=lambda p: len(p.parts), reverse=True):
        path.rmdir()  # fails (and so stops) if anything is left: nothing unlisted is ever removed
    root.rmdir()


def _is_own_partial(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and (path / PARTIAL_MARKER).is_file()


def discard_partial(partial: Path) -> None:
    """Remove an unfinished ``.partial`` that torchbay created (it carries the marker)."""
    import shutil

    if not partial.exists():
        return
    if not _is_own_partial(partial):
        raise CheckpointError(f"{partial} exists but was not created by torchbay (no {PARTIAL_MARKER}); torchbay "
                              f"uses this name while saving: move it away")
    shutil.rmtree(partial)


def siblings(final: Path) -> tuple[Path, Path]:
    return final.with_name(final.name + ".partial"), final.with_name(final.name + ".old")


def begin_partial(final: Path) -> Path:
    """Create ``<final>.partial`` with the marker (after :func:`recover_interrupted_save`)."""
    partial, _ = siblings(final)
    discard_partial(partial)
    partial.mkdir(parents=True)
    (partial / PARTIAL_MARKER).write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename,
                                                      "started": time.time()}))
    return partial


def publish(partial: Path, final: Path) -> None:
    """Atomically make the complete ``partial`` the checkpoint at ``final``."""
    _, old = siblings(final)
    (partial / PARTIAL_MARKER).unlink(missing_ok=True)
    fsync_tree_dirs(partial)
    wait_for_removals(old)  # the checkpoint the last save to this name replaced may still be being removed
    if old.is_dir() and not old.is_symlink() and final.exists() and _complete_manifest(old) is not None:
        remove_own_checkpoint(old, f"replaced by an earlier save to {final}; its removal had failed")  # retried
    if old.exists() or old.is_symlink():
        raise CheckpointError(f"{old} exists; torchbay needs this name to publish {final}: move it away")
    replaced = final.exists()
    if replaced:
        final.rename(old)
    partial.rename(final)
    fsync_dir(final.parent)
    if replaced:  # unlinking large files is slow: the caller goes on while it happens
        thread = threading.Thread(target=_remove_in_background, args=(old, final), name="torchbay-remove-old")
        _removals[_key(old)] = thread
        thread.start()


#: the removal in flight of each replaced checkpoint (``<final>.old``), by its absolute path
_removals: dict[str, threading.Thread] = {}


def _key(path: Path) -> str:
    return os.path.abspath(path)


def _remove_in_background(old: Path, final: Path) -> None:
    try:
        remove_own_checkpoint(old, f"replaced by the new checkpoint at {final}")
    except (CheckpointError, OSError) as exc:  # the next save to this path retries
        log.warning("torchbay: could not remove %s after publishing %s: %s", old, final, exc)


def wait_for_removals(old: Path | None = None) -> None:
    """Wait until the replaced checkpoint ``old`` is removed, or every one when ``old`` is None (a non-daemon
    thread also finishes at exit)."""
    for key in [_key(old)] if old is not None else list(_removals):
        thread = _removals.pop(key, None)
        if thread is not None:
            thread.join()


def _being_removed(old: Path) -> bool:
    thread = _removals.get(_key(old))
    return thread is not None and thread.is_alive()


def recover_interrupted_save(final: Path) -> None:
    """Finish or undo a save to ``final`` that a crash interrupted; never loses a complete checkpoint.

    A ``<final>.old`` that this process is removing (the checkpoint the last save to ``final`` replaced, once
    that save was published) is no interrupted save: it is left to its removal, which :func:`publish` waits for
    before it needs the name. A save does not wait for it here, so it does not stall on unlinking large files.
    """
    partial, old = siblings(final)
    removing_old = _being_removed(old)
    if not removing_old:
        wait_for_removals(old)  # a finished one: forget it
    for path in (partial,) if removing_old else (partial, old):
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise CheckpointError(f"{path} exists and is not a torchbay directory; torchbay uses this name while "
                                  f"saving {final}: move it away")
    partial_complete = partial.is_dir() and _complete_manifest(partial) is not None
    if partial.is_dir() and not partial_complete and not _is_own_partial(partial):
        raise CheckpointError(f"{partial} was not created by torchbay (no {PARTIAL_MARKER}); torchbay uses this "
                              f"name while saving: move it away")
    if removing_old:
        pass  # what the last published save replaced: publish() waits for its removal before it needs the name
    elif old.is_dir() and any(old.iterdir()) and _complete_manifest(old) is None:
        raise CheckpointError(f"{old} is not a torchbay checkpoint; torchbay uses this name while saving "
                              f"{final}: move it away")
    elif old.is_dir() and final.exists():
        # the interrupted save had published; what it replaced is left
        remove_own_checkpoint(old, f"left by an interrupted save; {final} is newer")
    elif old.is_dir():
        if partial_complete:  # crashed between the two renames: finish the publish
            partial.rename(final)
            fsync_dir(final.parent)
            remove_own_checkpoint(old, f"replaced by the interrupted save now published at {final}")
            log.warning("torchbay: finished publishing an interrupted save at %s", final)
            return
        discard_partial(partial)
        old.rename(final)
        fsync_dir(final.parent)
        log.warning("torchbay: restored the previous checkpoint %s from %s after an interrupted save", final, old)
        return
    if partial_complete:
        log.warning("torchbay: an interrupted save left a complete checkpoint in %s; publishing it at %s",
                    partial, final)
        publish(partial, final)
    elif partial.exists():
        log.warning("torchbay: removing the unfinished save %s", partial)
        discard_partial(partial)


def explain_missing(final: Path) -> str:
    """Why ``final`` cannot be loaded, naming where an interrupted save left the checkpoint."""
    partial, old = siblings(final)
    if _complete_manifest(old) is not None:
        return (f"{final} does not exist: a save was interrupted and the previous complete checkpoint is in {old}; "
                f"load that path, or call save_state('{final}') to restore it first")
    if _complete_manifest(partial) is not None:
        return (f"{final} does not exist: a save was interrupted after writing {partial} completely; load that "
                f"path, or call save_state('{final}') to publish it")
    return f"{final} does not exist"
