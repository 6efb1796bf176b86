"""Output directories that appear whole or not at all, and only where dstc may write.

A writer takes a lock beside the target, builds the new content in a hidden temporary directory next to it and
renames it into place at the end; on any error (or Ctrl-C) the temporary directory is removed and the target is
left as it was. A process killed outright cannot clean up: the next writer of the same target removes what it
left (under the lock, nobody else can be using it).

Ownership: every directory dstc writes holds the marker file ``.dstc-output``. An existing target is replaced
only when it holds that marker or is empty; a directory that merely contains files with dstc-like names
(manifest.json, export.json, ...) is someone else's and is refused.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from toolchain.errors import InputError, OutputError
from toolchain.interrupts import raise_if_interrupted

MARKER = ".dstc-output"
_MARKER_TEXT = "This directory was written by dstc; dstc may replace it.\n"
# Errors of the file system rather than of the program: reported as one line (exit 2), not a traceback.
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# ... and these, when they concern the output's own files (an unreadable input is another error).
_DENIED = {errno.EROFS, errno.EACCES, errno.EPERM}


def owned(directory: Path) -> bool:
    """Whether dstc wrote this directory (its marker is a regular file, not a link someone planted)."""
    marker = Path(directory) / MARKER
    return marker.is_file() and not marker.is_symlink()


def mark(directory: Path) -> None:
    (Path(directory) / MARKER).write_text(_MARKER_TEXT)


def check_writable_target(target: Path) -> Path:
    """The directory a writer will replace, resolved (a symbolic link is followed to what it names); InputError
    when it is not dstc's to replace. Call it before expensive work, so that bad output paths fail first."""
    target = Path(target).expanduser()
    target = target.resolve() if target.is_symlink() else Path(os.path.abspath(target))
    cwd = Path.cwd().resolve()
    if target == target.parent:
        raise InputError(f"{target} is the file system root: choose an output directory below it")
    if cwd == target or target in cwd.parents:
        raise InputError(f"{target} is the current directory or contains it: choose another output directory")
    if _foreign(target):
        raise InputError(f"{target} exists, is not empty and was not written by dstc (no {MARKER}); "
                         f"choose another directory or empty it")
    parent = next((p for p in target.parents if p.exists()), None)
    if parent is None or not os.access(parent, os.W_OK | os.X_OK) or not parent.is_dir():
        raise InputError(f"cannot write to {target}: {parent} is not a writable directory")
    reason = _cannot_create(parent, lambda: os.rmdir(tempfile.mkdtemp(prefix=".dstc-probe-", dir=parent)))
    if reason:
        raise InputError(f"cannot write to {target}: {reason}")
    return target


def _foreign(target: Path) -> bool:
    """Whether ``target`` is a directory with files in it but no marker (InputError when it is not a directory).

    Another dstc process may be replacing it meanwhile (rename it aside, rename its new output in, remove the old):
    the directory is looked at through one descriptor, and a verdict against it stands only if that directory is
    still the target afterwards; otherwise what is there now is looked at. An instant with no target is no target."""
    while True:
        try:
            fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return False
        except NotADirectoryError:
            if os.path.lexists(target):
                raise InputError(f"{target} exists and is not a directory") from None
            return False  # one of its parents is a file: the check of the parent says so
        except OSError as e:
            raise InputError(f"cannot write to {target}: {e.strerror}") from None
        try:
            looked_at = os.fstat(fd)
            foreign = not _marked(fd) and bool(os.listdir(fd))
        finally:
            os.close(fd)
        if not foreign:
            return False
        try:
            now = os.stat(target)
        except FileNotFoundError:
            continue
        if (now.st_dev, now.st_ino) == (looked_at.st_dev, looked_at.st_ino):
            return True


def _marked(directory_fd: int) -> bool:
    try:
        return stat.S_ISREG(os.stat(MARKER, dir_fd=directory_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def _cannot_create(directory: Path, probe) -> str | None:
    """Why ``probe`` (which creates and removes something in ``directory``) fails, in words that name the problem
    (os.access says yes to root everywhere, /proc and read-only mounts included), or None when it succeeds."""
    try:
        probe()
    except OSError as e:
        if e.errno == errno.EROFS:
            return f"{directory} is on a read-only file system"
        if e.errno in (errno.EACCES, errno.EPERM):
            return f"{directory} is not writable (permission denied)"
        if e.errno in _FULL:
            return f"{directory}: {e.strerror}"
        if e.errno in (errno.EEXIST, errno.ENOTDIR):
            return f"{directory} is not a directory"
        kind = _file_system(directory)  # e.g. /proc, where creating a file says "No such file or directory"
        return (f"{directory} is not a regular directory ({kind} file system): no file can be created in it"
                if kind else f"{directory}: {e.strerror}")
    return None


def _file_system(path: Path) -> str | None:
    """The type of the file system ``path`` is on, from /proc/self/mounts (None where there is none)."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    path = Path(os.path.realpath(path))
    best: tuple[int, str] | None = None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = Path(fields[1].replace("\\040", " "))
        if (path == point or point in path.parents) and (best is None or len(point.parts) > best[0]):
            best = (len(point.parts), fields[2])
    return best[1] if best else None


def is_write_error(error: BaseException, target: Path | None = None) -> bool:
    """An error that the file system gave a writer: a full disk (perhaps wrapped by a library that reports it as
    text), or a read-only / denied path of the output ``target`` (itself, or its temporary directory and lock
    beside it; another path's error, say the stage cache's, is not the output's to report)."""
    if isinstance(error, OSError) and error.errno in _FULL:
        return True
    if isinstance(error, OSError) and error.errno in _DENIED and target is not None \
            and isinstance(error.filename, (str, bytes)):
        path = Path(os.path.abspath(os.fsdecode(error.filename)))
        return any(p == target or (p.parent == target.parent and p.name.startswith(f".{target.name}."))
                   for p in (path, *path.parents))
    return "No space left on device" in str(error)


def write_error(target: Path, error: BaseException) -> OutputError:
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error).splitlines()[0]
    return OutputError(f"cannot write {target}: {reason}")


@contextmanager
def lock_file(path: Path, *, wait: bool, what: Path) -> Iterator[None]:
    """An exclusive lock on the file ``path`` (created), for writing ``what``. The lock file is removed on
    release; a process that locked a file another removed meanwhile tries again on the new one."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise InputError(f"{what} is being written by another dstc process (pid {holder}); wait for it to "
                             f"finish or choose another directory") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        try:
            os.unlink(path)
        finally:
            os.close(fd)


def _remove_leftovers(target: Path) -> None:
    """Temporary and replaced directories of earlier writers of this target that did not finish (killed, or
    failed while removing): under the lock, none of them can still be in use. A writer killed between moving
    the old target aside and renaming the new one in left no target: the old one is put back first."""
    if not target.exists():
        for old in sorted(target.parent.glob(f".{target.name}.old-*/{target.name}")):
            old.rename(target)
            break
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.old-*"):
        for leftover in target.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_output_dir(target: Path, *, wait: bool = False) -> Iterator[Path]:
    """Yield an empty, marked temporary directory; on success it replaces ``target``.

    ``wait``: block until another writer of the same target finishes (the stage cache) instead of failing at
    once with an InputError (a user's output directory)."""
    target = check_writable_target(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise write_error(target, e) from None
    with lock_file(target.parent / f".{target.name}.lock", wait=wait, what=target):
        target = check_writable_target(target)  # again, under the lock: another writer may have changed it
        try:
            _remove_leftovers(target)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
            tmp.chmod(0o777 & ~_umask())  # mkdtemp makes 0700; outputs get the user's usual permissions
            mark(tmp)
        except OSError as e:
            raise write_error(target, e) from None
        try:
            yield tmp
            raise_if_interrupted()  # an interrupt a finalizer swallowed still leaves the target as it was
            old = None
            if target.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-{os.getpid()}-", dir=target.parent))
                target.rename(old / target.name)
            tmp.rename(target)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if is_write_error(e, target) and not isinstance(e, InputError):
                raise write_error(target, e) from None
            raise


def ensure_output_dir(target: Path) -> Path:
    """A directory to add files to (reports): an existing dstc output, or a new or empty directory, which is
    marked as dstc's. Check it with check_writable_target before the work that fills it."""
    target = check_writable_target(target)
    try:
        target.mkdir(parents=True, exist_ok=True)
        if not owned(target):
            mark(target)
    except OSError as e:
        raise write_error(target, e) from None
    return target


def check_writable_file(path: Path) -> Path:
    """A file a command will write at the end (e.g. an HTML comparison): InputError now if it cannot be."""
    path = Path(path).expanduser().absolute()
    if path.is_dir():
        raise InputError(f"{path} is a directory, not a file")
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK | os.X_OK):
        raise InputError(f"cannot write {path}: {path.parent} is not a writable directory")
    if path.exists() and not os.access(path, os.W_OK):
        raise InputError(f"cannot write {path}: permission denied")
    reason = _cannot_create(path.parent, lambda: _probe_file(path.parent))
    if reason:
        raise InputError(f"cannot write {path}: {reason}")
    return path


def check_writable_dir(directory: Path, what: str, way_out: str) -> Path:
    """``directory`` (created if missing) when files can be created in it; otherwise an InputError naming ``what``
    (e.g. the stage cache, which is not the command's output), the reason and ``way_out``."""
    directory = Path(directory).expanduser().absolute()

    def probe() -> None:
        directory.mkdir(parents=True, exist_ok=True)
        _probe_file(directory)

    reason = _cannot_create(directory, probe)
    if reason:
        raise InputError(f"cannot write {what}: {reason}; {way_out}")
    return directory


def _probe_file(directory: Path) -> None:
    handle, probe = tempfile.mkstemp(prefix=".dstc-probe-", dir=directory)
    os.close(handle)
    os.unlink(probe)


def write_file_atomically(path: Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(text.encode())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_error(path, e) from None
