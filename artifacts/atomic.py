"""Atomic file writes, leftovers of dead writers, and the writer lock: written once for prep and runtime.

A temporary name carries its writer's pid (`.tmp-<pid>-<token>-<name>`), so anyone can tell a
live writer's work in progress from a dead writer's leftover and delete the latter. Files are
created with mode 0666 minus the umask, like other tools' output (mkstemp would make them 0600).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

from artifacts.format import TMP_PREFIX

LOCK_FILE = ".lock"
# Fault injection for the interruption tests: a process whose $SPECVOCAB_PAUSE_AT names a pause point
# stops itself there (SIGSTOP), so a test can kill it at exactly that point. Unset, it costs nothing.
PAUSE_ENV = "SPECVOCAB_PAUSE_AT"


def pause_point(name: str) -> None:
    """Stop this process (SIGSTOP) when $SPECVOCAB_PAUSE_AT equals `name`; for interruption tests."""
    if os.environ.get(PAUSE_ENV) == name:
        os.kill(os.getpid(), signal.SIGSTOP)


def current_umask() -> int:
    """Return the process's umask (reading it means setting it; it is put back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def tmp_name(name: str) -> str:
    """Return a fresh temporary name for `name` that records this process's pid."""
    return f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{name}"


def writer_pid(entry_name: str) -> int | None:
    """Return the pid recorded in a temporary name, or None if it is not one of ours."""
    if not entry_name.startswith(TMP_PREFIX):
        return None
    pid = entry_name[len(TMP_PREFIX):].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def pid_alive(pid: int) -> bool:
    """Return whether a process with this id runs: it exists and has not exited.

    A killed process stays a zombie until its parent reaps it, and a multithreaded one takes a
    moment to exit after kill -9; either would otherwise hold a lock, or keep its leftovers, as if
    it still wrote.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return not is_zombie(pid)


def is_zombie(pid: int) -> bool:
    """Return whether a process has exited but is not reaped yet (Linux's /proc; elsewhere False)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields_after_name = stat.rsplit(")", 1)[-1].split()  # the name, in parentheses, may hold spaces
    return bool(fields_after_name) and fields_after_name[0] in ("Z", "X")  # zombie, or dead


def is_dead_leftover(entry_name: str) -> bool:
    """Return whether an entry is a temporary of a writer that no longer runs (or of unknown owner)."""
    pid = writer_pid(entry_name)
    return entry_name.startswith(TMP_PREFIX) and (pid is None or not pid_alive(pid))


def remove_dead_leftovers(directory: Path) -> list[str]:
    """Delete the temporaries of dead writers in `directory`; return their names."""
    removed = []
    for entry in sorted(directory.iterdir()) if directory.is_dir() else []:
        if is_dead_leftover(entry.name):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry.name)
    return removed


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call write(tmp) to create a temporary sibling of `path`, fsync it, rename it over `path`.

    The file gets the umask's mode whatever mode `write` created it with. A failure or an interrupt
    leaves `path` as it was and removes the temporary; an OSError (a full disk) names `path`, not the
    temporary, which is gone by then.
    """
    tmp = path.parent / tmp_name(path.name)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())  # some writers (safetensors) create 0600
        fsync_file(tmp)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        e.filename = str(path)
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically."""
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_json(path: Path, value: object) -> None:
    """Replace `path` with `value` as indented JSON (no NaN) atomically."""
    text = json.dumps(value, indent=2, sort_keys=True, allow_nan=False) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (renames) to disk where the OS allows it."""
    if os.name == "nt":  # Windows cannot open a directory for fsync.
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Flush a file's content to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WriterLock:
    """An exclusive writer lock: `<dir>/.lock` holding the writer's pid, taken over from a dead writer.

    Two writers into one directory would both do the long work before one of them lost; the lock
    refuses the second at once. A lock whose pid no longer runs (kill -9) is stale and replaced.
    """

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / LOCK_FILE
        self.held = False

    def holder(self) -> int | None:
        """Return the pid of a live process holding the lock, or None."""
        try:
            text = self.path.read_text().strip()
        except OSError:
            return None
        pid = int(text) if text.isdigit() else None
        return pid if pid is not None and pid_alive(pid) else None

    def acquire(self) -> int | None:
        """Take the lock; return None on success, else the pid of the live writer that holds it."""
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            except FileExistsError:
                holder = self.holder()
                if holder is not None:
                    return holder
                self._remove_stale()
                continue
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()}\n")
            self.held = True
            return None
        return self.holder() or -1

    def release(self) -> None:
        """Drop the lock if this object holds it."""
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def _remove_stale(self) -> None:
        """Remove a lock whose writer is gone (rename first, so two takers cannot both remove it)."""
        aside = self.path.parent / tmp_name("stale-lock")
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:
            return
        # Between our check and the rename a live writer may have taken it: give it back.
        text = aside.read_text().strip() if aside.exists() else ""
        if text.isdigit() and pid_alive(int(text)):
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
        aside.unlink(missing_ok=True)
