"""Checkpoints inside the machine: the namespace (what pickles) and the workspace files.

Stdlib only, Python 3.8+: runs inside the machine (see ``agent.py``).
"""

import os
import stat
import sys
import types


class SaveLoad:
    """The agent's save and load (a part of ``serving.Agent``)."""

    def save(self, path):
        """Save the namespace (what pickles) and the workspace files into directory ``path``."""
        import tarfile  # here, not at start-up: most machines never save

        from . import nsstream

        modules, values = {}, []
        for key, val in list(self.ns.items()):
            if key.startswith("__") or key in ("display", "_"):
                continue
            if isinstance(val, types.ModuleType):
                modules[key] = val.__name__
            else:
                values.append((key, val))
        values.sort(key=lambda kv: kv[0])
        os.makedirs(path, exist_ok=True)
        head = {"modules": modules, "seed": self.seed, "name": self.name}
        # Each variable is pickled straight into the host's fifo where it made one (a file
        # elsewhere): the pickle is never a whole second copy of the variables in memory.
        with _sink(os.path.join(path, "namespace.pkl")) as fh:
            saved, skipped = nsstream.dump(fh, head, values)
        del values
        if self.workdir:  # scripts a cell's own `python -m pip` wrote name this interpreter: the workspace goes out
            from . import pipsite

            pipsite.portable_scripts(os.path.join(self.workdir, pipsite.TARGET, "bin"), sys.executable)
        # Streamed ("w|": a fifo can't seek): into the host's fifo where it made one, so the
        # archive is never a second copy of the workspace's files in this machine's memory.
        with _sink(os.path.join(path, "workspace.tar")) as fh, tarfile.open(fileobj=fh, mode="w|") as tar:
            if self.workdir and os.path.isdir(self.workdir):
                for entry in sorted(os.listdir(self.workdir)):
                    tar.add(os.path.join(self.workdir, entry), arcname=entry)
        return {"t": "done", "status": "ok", "skipped": skipped, "saved": saved + sorted(modules)}

    def load(self, path):
        """Bring back what :meth:`save` wrote: workspace files, then variables."""
        import tarfile

        from . import nsstream

        ws = os.path.join(path, "workspace.tar")
        if self.workdir and os.path.exists(ws):
            # exactly the plain tar the host checked: tarfile.open's default tries gzip, bz2 and xz
            # first, and the same bytes can be a harmless tar and a gzip of another archive
            with tarfile.open(ws, "r:") as tar:
                files = {}  # name -> a regular file (or a hard link to one) was last there
                for member in tar.getmembers():
                    if member.name.startswith("/") or ".." in member.name.split("/"):  # "..." is a name
                        raise ValueError("unsafe path in checkpoint: %s" % member.name)
                    # tarfile makes a hard link to a symlink a copy of it, its text unchanged: it
                    # points elsewhere from its own folder (sub/s -> ../y as h: outside)
                    if member.islnk() and not files.get(os.path.normpath(member.linkname)):
                        raise ValueError("hard link to something not a file before it in checkpoint: %s" % member.name)
                    files[os.path.normpath(member.name)] = member.isfile() or member.islnk()
                _links_by_name(tar)
                if hasattr(tarfile, "data_filter"):  # Python 3.8.17+/3.12: links can't leave the workspace
                    tar.extractall(self.workdir, filter="data")
                else:
                    tar.extractall(self.workdir)
        failed, names = [], []
        # A fifo the host writes as this reads (a file elsewhere): one variable at a time.
        with open(os.path.join(path, "namespace.pkl"), "rb") as fh:
            data, variables = nsstream.load(fh)
            for key, modname in data.get("modules", {}).items():
                try:
                    self.ns[key] = __import__(modname, fromlist=["_"])
                except Exception as exc:
                    failed.append("%s (%s: %s)" % (key, type(exc).__name__, exc))
            for key, val, err in variables:
                names.append(key)
                if err is not None:
                    failed.append("%s (%s: %s)" % (key, type(err).__name__, err))
                else:
                    self.ns[key] = val
                del val
        if data.get("seed") is not None:
            self.apply_seed(data["seed"])
        self._reward_restored()
        return {"t": "done", "status": "ok", "skipped": failed, "saved": sorted(names) + sorted(data.get("modules", {}))}

    def restored_as_saved(self):
        """This agent woke up in a whole-machine checkpoint (a microVM's snapshot, its memory as
        it was): its `reward` is then the saved one, as after a load."""
        self._reward_restored()

    def _reward_restored(self):
        # A `reward` the checkpoint's cells set is not this machine's: it is reported, as on a
        # fresh machine, once a cell here sets one (see Cells._reward_and_metrics).
        self.inherited_reward = (self.ns["reward"],) if "reward" in self.ns else None


def _sink(path):
    """A file to write ``path`` into: the fifo the host made there, whose other end it reads as
    this writes (opened without waiting: no reader is an error, ENXIO), else a new file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return open(path, "wb")
    if not stat.S_ISFIFO(st.st_mode):
        return open(path, "wb")
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "wb")


def _links_by_name(tar):
    """Have ``tar`` find a link's target by name in a dict made once. A link tarfile can't make
    (a folder already at its name, a name too long) is made as a copy of its target, which
    tarfile looked for among every member, for each such link: 5,000 links took 76 s here,
    50,000 were stopped after 6 minutes (a checkpoint made that way). The same member is found:
    for a symlink, the last of its target's name; for a hard link, the last before it; only a file (else a KeyError: tarfile skips the link)."""
    import bisect

    named = {}
    for member in tar.getmembers():
        offsets, members = named.setdefault(os.path.normpath(member.name), ([], []))
        offsets.append(member.offset)
        members.append(member)

    def find(tarinfo):
        if tarinfo.issym():
            name = "/".join(filter(None, (os.path.dirname(tarinfo.name), tarinfo.linkname)))
        else:
            name = tarinfo.linkname
        offsets, members = named.get(os.path.normpath(name), ((), ()))
        # (tarinfo may be the data filter's copy of the member: the same offset)
        at = len(offsets) if tarinfo.issym() else bisect.bisect_left(offsets, tarinfo.offset)
        # only a file is copied for a link tarfile can't make: a symlink copied keeps its text,
        # which leads elsewhere from the copy's folder
        if not at or not (members[at - 1].isfile() or members[at - 1].islnk()):
            raise KeyError("linkname %r not found" % name)
        return members[at - 1]

    tar._find_link_target = find  # tarfile's own (each Python since 3.2), as a name lookup
