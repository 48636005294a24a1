"""This user's key, and the signature of each checkpoint row this user's kernels write.

A ledger row only *names* a checkpoint file and says who saved it, and a copied folder carries
someone else's ledger: nothing in a row tells this user's own saves from a copy's. So each row a
kernel writes carries an HMAC-SHA256 (``checkpoint_more.mac``) under a per-user secret key,
over what a restore acts on: the checkpoint's name, its session, node and backend, the file its
row names and that file's SHA-256. A row whose MAC verifies is this user's own; any other (a
copied folder's, another user's, or one saved before rows were signed) is someone else's: smol's
engine (a host process) never reads its file, and other backends' restores check it as a file
from elsewhere. ``%smol checkpoint trust NAME`` signs one the user vouches for.

The key is 32 random bytes in ``$SMOLBENCH_STATE`` (else ``$XDG_STATE_HOME/smolbench``, else
``~/.local/state/smolbench``), file ``checkpoint.key``: made on first need, mode 0600, and used
only while it is a plain file of the user's own that no one else can read (never through a link).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from .errors import SmolbenchError

KEY_FILE = "checkpoint.key"
KEY_BYTES = 32
VERSION = "smolbench checkpoint row 1"  # what a MAC is of: its message's first item


def state_dir() -> Path:
    """Where smolbench keeps this user's own state (the key): ``$SMOLBENCH_STATE``, else
    ``$XDG_STATE_HOME/smolbench`` (an absolute one, as the XDG spec says), else ``~/.local/state/smolbench``."""
    env = os.environ.get("SMOLBENCH_STATE")
    if env:
        chosen = Path(env).expanduser()
        if not chosen.is_absolute():  # it would move with the kernel's working folder
            raise SmolbenchError(f"$SMOLBENCH_STATE is {env!r}, a relative path, so the folder of your checkpoint key "
                                 "would move with the working folder: set it to an absolute path")
        return chosen
    xdg = os.environ.get("XDG_STATE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "smolbench"
    try:
        return Path.home() / ".local" / "state" / "smolbench"
    except RuntimeError:  # no $HOME and no passwd entry (a container's uid)
        raise NoHome("there is no home folder here ($HOME unset, no passwd entry) to keep your checkpoint key in: "
                     "set $SMOLBENCH_STATE to a folder of your own") from None


class NoHome(SmolbenchError):
    """No folder to keep the key in: no $SMOLBENCH_STATE, no $XDG_STATE_HOME and no home."""


def key_path() -> Path:
    return state_dir() / KEY_FILE


def key(create: bool = True) -> bytes | None:
    """This user's key (made now when there is none and ``create``; else None); one line naming
    the fix when the file can't be trusted: a link, not the user's own, readable by others, or not
    a key at all."""
    path = key_path()
    try:
        return _read(path)
    except (FileNotFoundError, NotADirectoryError):  # none there (its folder may not be one: none can be)
        if not create:
            return None
    return _make(path)


def key_or_why() -> str | None:
    """Before a save: None when this user's key is there (made now if need be); the save's
    warning when no key can be made (no writable home or state folder: a container's): the
    save is then recorded unsigned, so it restores as a file from elsewhere does. A key file
    that is there but can't be trusted is its one line, raised."""
    return _key_or_why()[1]


def key_if_any() -> bytes | None:
    """This user's key, made now if need be; None when none can be made (:func:`key_or_why`)."""
    return _key_or_why()[0]


def _key_or_why() -> tuple[bytes | None, str | None]:
    try:
        return key(), None
    except (OSError, SmolbenchError) as exc:
        if not isinstance(exc, NoHome) and os.path.lexists(key_path()):
            raise
        why = exc if isinstance(exc, SmolbenchError) else f"{exc.strerror or exc}"
        return None, (f"saved unsigned: no checkpoint key could be made ({why}), so this checkpoint restores as a "
                      "file from elsewhere (checked as one; on smol: `%smol checkpoint trust` once a key can be made)")


def _refuse(path: Path, why: str, fix: str) -> SmolbenchError:
    return SmolbenchError(f"refusing the checkpoint key {path}: {why}, so it can't vouch for your checkpoints; {fix}")


def _read(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise
    except OSError as exc:
        if os.path.islink(path):
            raise _refuse(path, "it is a symbolic link", f"remove the link (`rm {path}`): a new key is made") from None
        raise SmolbenchError(f"can't read the checkpoint key {path} ({exc.strerror}): check it and its folder") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, "it is not a plain file", f"remove it (`rm {path}`): a new key is made")
        if st.st_uid != os.geteuid():
            raise _refuse(path, f"it belongs to uid {st.st_uid}, not you (uid {os.geteuid()})",
                          f"remove it (`rm {path}`): a new key is made")
        if st.st_mode & 0o077:
            raise _refuse(path, f"others can read or change it (mode {stat.S_IMODE(st.st_mode):04o})",
                          f"remove it (`rm {path}`, then re-trust your checkpoints), or `chmod 600 {path}` if no one else "
                          "has read it")
        data = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != KEY_BYTES:
        raise _refuse(path, f"it holds {len(data)} bytes, not a key of {KEY_BYTES}", f"remove it (`rm {path}`): a new key is made")
    return data


def _make(path: Path) -> bytes:
    """A new key at ``path``, written whole under a name of its own (O_EXCL, O_NOFOLLOW, 0600)
    and then linked into place, so another kernel making one meanwhile never reads half a key:
    whichever link comes first is the key both use."""
    folder = path.parent
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise SmolbenchError(f"can't make the folder {folder} for the checkpoint key ({exc.strerror}): "
                             "check it, or set $SMOLBENCH_STATE to a folder of your own") from None
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise SmolbenchError(f"refusing to keep the checkpoint key in {folder}: it is not a folder of yours that only "
                             f"you can write in (mode {stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid}); "
                             f"`chmod go-w {folder}`, or set $SMOLBENCH_STATE to a folder of your own")
    part = folder / f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    data = secrets.token_bytes(KEY_BYTES)
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(part, path, follow_symlinks=False)
        except FileExistsError:  # another kernel's came first (or a link is there: refused by _read)
            return _read(path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(part)
    return data


def _message(row: dict[str, Any], sha256: str | None) -> bytes:
    fields = [VERSION, row.get("name"), row.get("session_id"), row.get("node_id"), row.get("backend"),
              row.get("path"), sha256]
    return json.dumps(fields, default=str, ensure_ascii=True, separators=(",", ":")).encode()


def mac(row: dict[str, Any], sha256: str, secret: bytes) -> str:
    """The MAC of checkpoint ``row`` (its name, session_id, node_id, backend and path as the
    ledger keeps them) whose file's SHA-256 is ``sha256``, under ``secret`` (this user's key)."""
    return hmac.new(secret, _message(row, sha256), hashlib.sha256).hexdigest()


def signed(row: dict[str, Any], secret: bytes | None) -> bool:
    """Whether ``row`` carries a MAC of its own fields and its ``sha256`` under ``secret`` (None: no key yet)."""
    got, digest = row.get("mac"), row.get("sha256")
    if secret is None or not isinstance(got, str) or not isinstance(digest, str):
        return False
    return hmac.compare_digest(mac(row, digest, secret), got)


def _overlap(real: str, folder: str) -> bool:
    """Whether real path ``real`` is ``folder``, is inside it, or holds it."""
    return real == folder or real.startswith(folder.rstrip("/") + "/") or _holds(real, folder)


def _holds(real: str, folder: str) -> bool:
    """Whether real path ``real`` is ``folder`` or holds it."""
    return real == folder or folder.startswith(real.rstrip("/") + "/")


def key_overlap(host: str | os.PathLike[str]) -> str | None:
    """The real path of the key's folder when host folder ``host`` (as its real path) is, holds or
    is inside it, else None."""
    try:
        key_dir = os.path.realpath(state_dir())
    except NoHome:  # no key can be kept here, so none can be exposed
        return None
    return key_dir if _overlap(os.path.realpath(host), key_dir) else None


_GUARDED: set[str] = set()  # real paths: this process's ledgers' folders and checkpoint folders


def guard(*folders: str | os.PathLike[str]) -> None:
    """From now on, no machine of this process gets a writable volume that is or holds one of
    ``folders`` (a Workbench's ledger's folder and checkpoint folder), checked again at every bind:
    a volume's path can become a link to one after the Workbench checked it."""
    _GUARDED.update(os.path.realpath(f) for f in folders)


def volume_refusal(host: str, readonly: bool) -> str | None:
    """Why a machine may not have host folder ``host`` as a volume, in one line (problem, then fix)
    that starts "its host folder …" (the caller says which volume); None when it may. Every path is
    taken as its real path (links resolved), as volumes are. The key's folder (:func:`state_dir`) is
    never one, nor in or above one: a machine reading the key signs rows as this user. A folder
    :func:`guard` named is never a writable one, nor in a writable one: a machine there rewrites
    the ledger, or a signed checkpoint file after its restore hashed it."""
    key_dir = key_overlap(host)
    if key_dir is not None:
        return (f"its host folder {host} is, holds or is inside the folder of your checkpoint key ({key_dir}): a "
                "machine could read the key and sign checkpoints as yours; mount a folder that neither holds nor is "
                "in it (or set $SMOLBENCH_STATE to a folder outside what you mount)")
    if readonly:
        return None
    real = os.path.realpath(host)
    for folder in sorted(_GUARDED):
        if _holds(real, folder):
            return (f"its host folder {host} is writable and is or holds {folder}, where this kernel keeps its "
                    "ledger or checkpoints: a machine could rewrite the ledger, or a checkpoint file after a restore "
                    "checked it; make the volume readonly = true, mount a folder that doesn't hold it, or keep the "
                    "ledger elsewhere (`--ledger PATH`)")
    return None


def check_image(folder: str | os.PathLike[str]) -> None:
    """Refuse a rootfs image folder (a Smolfile's ``image = "PATH"``, someone else's perhaps) that
    is, holds or is inside the key's folder, in one line: the machine boots on it and reads all of
    it (third audit: ``image = "/"`` gave a smol VM the host's whole root, the key with it, where the
    same folder as a read-only volume was refused)."""
    key_dir = key_overlap(folder)
    if key_dir is not None:
        raise SmolbenchError(f"refusing the image folder {os.fspath(folder)}: it is, holds or is inside the folder of "
                             f"your checkpoint key ({key_dir}), and a machine reads all of its image; use a rootfs "
                             "folder of its own (`smolbench image build`), or set $SMOLBENCH_STATE to a folder outside it")


def check_volume(host: str, readonly: bool, guest: str) -> None:
    """Refuse the volume at ``guest`` whose host folder is reached at ``host`` in one line, where
    :func:`volume_refusal` says why (the Workbench's check, and each backend's where it binds)."""
    exposed = volume_refusal(host, readonly)
    if exposed is not None:
        raise SmolbenchError(f"refusing the volume at {guest}: {exposed}")
