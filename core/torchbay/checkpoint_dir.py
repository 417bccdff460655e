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

import contextlib
import json
import logging
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

from torchbay.errors import CheckpointError

log = logging.getLogger("torchbay")

MANIFEST = "torchbay_manifest.json"
PARTIAL_MARKER = ".torchbay_partial"
FORMAT_VERSION = 2
REQUIRED_FIELDS = ("format_version", "kind", "files")
KINDS = ("state", "model")


# --- files ------------------------------------------------------------------------------


#: bytes hashed from the mapping before its pages are dropped again: reading a large file must
#: not raise the process's resident memory by the file's size (it counts against a load's peak)
HASH_CHUNK = 8 << 20


def file_digest(fp) -> str:
    """xxh3-128 of the open file ``fp``, read from the page cache without a copy and without
    keeping the file resident in this process (each chunk's pages are dropped once hashed)."""
    import xxhash

    hasher = xxhash.xxh3_128()
    size = os.fstat(fp.fileno()).st_size
    if not size:
        return hasher.hexdigest()
    with mmap.mmap(fp.fileno(), 0, access=mmap.ACCESS_READ) as view:
        data = memoryview(view)
        try:
            for start in range(0, size, HASH_CHUNK):
                hasher.update(data[start:start + HASH_CHUNK])
                if _MADV_DONTNEED is not None:  # a read-only file mapping: the pages stay in the page cache
                    view.madvise(_MADV_DONTNEED, start, min(HASH_CHUNK, size - start))
        finally:
            data.release()
    return hasher.hexdigest()


_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None) if hasattr(mmap.mmap, "madvise") else None


def file_record(path: Path, sync: bool = True) -> dict[str, Any]:
    """Size and xxh3-128 of one file, fsync'ed to disk first when ``sync``."""
    with open(path, "rb") as fp:
        if sync:
            os.fsync(fp.fileno())
        size = os.fstat(fp.fileno()).st_size
        return {"size": size, "xxh3_128": file_digest(fp)}


# records of files fsync'ed and hashed right after they were written (by :func:`record_now`, in
# the thread that wrote them, while other files are still being written), keyed by path; a
# record is used only while the file is still the one that was hashed (same inode, size, mtime)
_recorded: dict[str, tuple[tuple, dict[str, Any]]] = {}
_recorded_lock = threading.Lock()


def _identity(path: Path) -> tuple:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def record_now(directory: Path, names: Iterable[str]) -> list[str]:
    """fsync and hash ``names`` now (right after writing them); :func:`record_files` reuses the records."""
    names = list(names)
    for name in names:
        path = directory / name
        record = file_record(path)
        with _recorded_lock:
            _recorded[str(path.absolute())] = (_identity(path), record)
    return names


def _recorded_or_new(path: Path, sync: bool) -> dict[str, Any]:
    with _recorded_lock:
        known = _recorded.pop(str(path.absolute()), None)
    if known is not None and known[0] == _identity(path):
        return known[1]
    return file_record(path, sync)


class RecordingWriter:
    """A new file written through ``write``: hashed as the bytes pass, sent to disk while it
    grows (``sync_file_range`` on Linux, so that the final fsync has little left to do),
    fsync'ed on :meth:`close` and recorded for :func:`record_files` (no second read)."""

    KICK = 8 << 20  # bytes written between two requests to start writing back

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = open(self.path, "wb", buffering=0)
        import xxhash

        self._hasher = xxhash.xxh3_128()
        self._size = self._kicked = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._hasher.update(view)
        written = 0
        while written < len(view):  # a raw file may write less than asked
            written += self._file.write(view[written:])
        self._size += written
        if self._size - self._kicked >= self.KICK:
            _start_writeback(self._file.fileno(), self._kicked, self._size - self._kicked)
            self._kicked = self._size
        return written

    def flush(self) -> None:
        pass  # unbuffered

    def close(self) -> dict[str, Any]:
        try:
            os.fsync(self._file.fileno())
        finally:
            self._file.close()
        record = {"size": self._size, "xxh3_128": self._hasher.hexdigest()}
        if os.stat(self.path).st_size != self._size:
            raise CheckpointError(f"{self.path} has {os.stat(self.path).st_size} bytes after writing {self._size}")
        with _recorded_lock:
            _recorded[str(self.path.absolute())] = (_identity(self.path), record)
        return record

    def abort(self) -> None:
        self._file.close()


def write_recorded(path: Path, write) -> str:
    """``write(file)`` into the new file ``path`` through a :class:`RecordingWriter`; its name."""
    writer = RecordingWriter(path)
    try:
        write(writer)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return Path(path).name


_crc_lock = threading.Lock()
_crc_users = 0  # torchbay saves starting now; the first turns the CRC off, the last restores it
_crc_before = True


@contextlib.contextmanager
def _zip_crc_off():
    """torch's zip writers created inside skip the CRC-32 (torch >= 2.6); yields ``release``, which
    gives torch its own setting back at once: torch reads it only when it creates a writer."""
    import torch

    global _crc_users, _crc_before
    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or set_ is None:
        yield lambda: None
        return
    with _crc_lock:
        if _crc_users == 0:
            _crc_before = get()
            set_(False)
        _crc_users += 1
    released = False

    def release() -> None:
        global _crc_users
        nonlocal released
        if released:
            return
        released = True
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                set_(_crc_before)

    try:
        yield release
    finally:
        release()


class _ReleaseOnFirstWrite:
    """A file for ``torch.save`` that calls ``release`` before its first write: by then torch's
    zip writer exists and has read the CRC setting."""

    def __init__(self, file: Any, release) -> None:
        self._file = file
        self._release = release

    def write(self, data) -> int:
        self._release()
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()


def torch_save_recorded(obj: Any, path: Path) -> str:
    """``torch.save(obj, path)`` through a :class:`RecordingWriter`; the file's name.

    The zip records are written without their CRC-32 (``torch.serialization.set_crc32_options``;
    ``torch.load`` does not check it): computing it took more than half of the time of a large
    ``torch.save``, and the manifest's xxh3-128 of the whole file, checked on every load, is the
    stronger check. That option is torch's process-wide setting, read when a zip writer is created:
    torchbay turns it off just before its own ``torch.save`` starts and restores it before the first
    byte is written, so the user's own ``torch.save`` calls keep their CRC (only one that starts
    in another thread while torchbay pickles its object would be written without it).
    """
    import torch

    with _zip_crc_off() as release:
        return write_recorded(path, lambda file: torch.save(obj, _ReleaseOnFirstWrite(file, release)))


_sync_file_range: Any = None


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` to disk, without waiting."""
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            function = libc.sync_file_range
            function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            _sync_file_range = function
        except (OSError, AttributeError):
            pass
    if _sync_file_range:
        _sync_file_range(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE; a failure only loses the head start


def _parallel(fn, items: list, threads: int = 4) -> list:
    if len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(max_workers=min(threads, len(items))) as pool:  # fsync releases the GIL
        return list(pool.map(fn, items))


def record_files(directory: Path, names: Iterable[str], sync: bool = True) -> dict[str, dict[str, Any]]:
    """Manifest records of ``names`` (relative to ``directory``), fsync'ed in parallel (files that
    :func:`record_now` recorded as they were written are not read again)."""
    names = sorted(set(names))
    records = _parallel(lambda n: _recorded_or_new(directory / n, sync), names)
    return dict(zip(names, records))


def verify_files(directory: Path, files: dict[str, dict[str, Any]], names: Iterable[str]) -> list[str]:
    """Problems with the listed ``names`` (missing, wrong size, wrong checksum); [] when intact."""
    def check(name: str) -> str | None:
        path = directory / name
        expected = files[name]
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected.get("size"):
            return f"{name} has {size} bytes, the manifest recorded {expected.get('size')}"
        if "xxh3_128" in expected and file_record(path, sync=False)["xxh3_128"] != expected["xxh3_128"]:
            return f"{name} does not match its checksum (the file is corrupted or was changed after the save)"
        return None

    return [p for p in _parallel(check, sorted(names)) if p]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree_dirs(root: Path) -> None:
    """fsync every directory under ``root`` (their entries), deepest first, then ``root``."""
    dirs = sorted((p for p in root.rglob("*") if p.is_dir() and not p.is_symlink()),
                  key=lambda p: len(p.parts), reverse=True)
    for d in [*dirs, root]:
        fsync_dir(d)


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
        raise CheckpointError(f"{path} lists file(s) outside the checkpoint directory ({', '.join(map(str, outside[:3]))}); "
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
    if old.exists() or old.is_symlink():
        raise CheckpointError(f"{old} exists; torchbay needs this name to publish {final}: move it away")
    replaced = final.exists()
    if replaced:
        final.rename(old)
    partial.rename(final)
    fsync_dir(final.parent)
    if replaced:  # unlinking large files is slow: the caller goes on while it happens
        thread = threading.Thread(target=_remove_in_background, args=(old, final), name="torchbay-remove-old")
        _removals.append(thread)
        thread.start()


_removals: list[threading.Thread] = []


def _remove_in_background(old: Path, final: Path) -> None:
    try:
        remove_own_checkpoint(old, f"replaced by the new checkpoint at {final}")
    except (CheckpointError, OSError) as exc:  # the next save to this path retries
        log.warning("torchbay: could not remove %s after publishing %s: %s", old, final, exc)


def wait_for_removals() -> None:
    """Wait until replaced checkpoints are removed (a non-daemon thread also finishes at exit)."""
    while _removals:
        _removals.pop().join()


def recover_interrupted_save(final: Path) -> None:
    """Finish or undo a save to ``final`` that a crash interrupted; never loses a complete checkpoint."""
    wait_for_removals()
    partial, old = siblings(final)
    for path in (partial, old):
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise CheckpointError(f"{path} exists and is not a torchbay directory; torchbay uses this name while "
                                  f"saving {final}: move it away")
    partial_complete = partial.is_dir() and _complete_manifest(partial) is not None
    if partial.is_dir() and not partial_complete and not _is_own_partial(partial):
        raise CheckpointError(f"{partial} was not created by torchbay (no {PARTIAL_MARKER}); torchbay uses this "
                              f"name while saving: move it away")
    if old.is_dir() and any(old.iterdir()) and _complete_manifest(old) is None:
        raise CheckpointError(f"{old} is not a torchbay checkpoint; torchbay uses this name while saving "
                              f"{final}: move it away")
    if old.is_dir() and final.exists():
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
