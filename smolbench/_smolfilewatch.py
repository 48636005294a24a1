"""Noticing that the Smolfile an up read says something else now (said once, in one line)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

from .errors import SmolfileError
from .smolfile import parse_smolfile, read_bytes, shown, smolfile_text, unreadable
from .spec import MachineSpec

# MachineSpec fields as the Smolfile names them
_KEYS = {"net": "network", "allow_hosts": "network", "allow_cidrs": "network", "disk_mib": "disk",
         "episodes_fresh": "episodes"}


class SmolfileWatch:
    """Notices, once, that the Smolfile an up read now says something else: its machines keep the
    spec they were made with, and the next cell or fork says how to apply the new one. A stat per
    call; the file is read, hashed and parsed again only when its stat changed, and a change that
    leaves the spec as it was (a comment, spacing) says nothing."""

    def __init__(self, path: str | os.PathLike[str], spec: MachineSpec) -> None:
        self.path, self.spec, self.said = Path(path).expanduser(), spec, False
        self._stamp: tuple[int, ...] | None = None
        self._digest: str | None = None
        self._pending = self._look()  # changed since it was parsed for the up: said at the first cell

    def news(self) -> str | None:
        """The one line to say now (``%smol`` words), or None: unchanged, or said already."""
        if self.said:
            return None
        line, self._pending = self._pending or self._look(), None
        self.said = line is not None
        return line

    def _look(self) -> str | None:
        try:
            st = os.stat(self.path)
            stamp: tuple[int, ...] | None = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        except OSError:
            stamp = None
        if stamp == self._stamp and self._digest is not None:
            return None
        self._stamp = stamp
        error: OSError | None = None
        try:
            data: bytes | None = read_bytes(self.path)
        except OSError as exc:
            data, error = None, exc
        digest = hashlib.sha256(data).hexdigest() if data is not None else ""
        if digest == self._digest:
            return None
        self._digest = digest
        name, apply = shown(self.path), "`%smol down` then `%smol up` to apply it"
        if data is None:
            if error is not None and not isinstance(error, FileNotFoundError):
                why, fix = unreadable(error)
                return (f"smolbench: the Smolfile {name} can't be read now ({why}); machines keep the spec they "
                        f"were made with: {fix}, then {apply}")
            return f"smolbench: the Smolfile {name} is gone since `%smol up`; machines keep the spec they were made with"
        try:
            now = parse_smolfile(smolfile_text(data, name), source=self.spec.source or name,
                                 base_dir=str(self.path.resolve().parent))
        except SmolfileError as exc:
            why = str(exc).splitlines()[0][:200]
            return (f"smolbench: the Smolfile {name} changed since `%smol up` and doesn't parse now ({why}); machines "
                    f"keep the spec they were made with: fix it, then {apply}")
        keys = list(dict.fromkeys(_KEYS.get(f.name, f.name) for f in dataclasses.fields(now)
                                  if getattr(now, f.name) != getattr(self.spec, f.name)))
        if not keys:
            return None
        return (f"smolbench: the Smolfile {name} changed since `%smol up` ({', '.join(keys)}); machines keep the spec "
                f"they were made with: {apply}")
