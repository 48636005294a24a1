"""A checkpoint's namespace as a stream: each variable pickled straight into the file it is
saved to (a fifo the host reads as it is written), and read back one variable at a time:
never a whole copy of the pickle in the machine's memory.

Layout: MAGIC, then segments. A segment is chunks (a 4-byte big-endian length, then that
many bytes) ended by a zero length (whole) or DROPPED (its pickling failed midway: ignore
it). First the head (a pickle of the modules, seed and name), then for each variable its
name (UTF-8) and its pickle, then an empty name. A file that doesn't start with MAGIC is the
earlier layout: one pickle of a dict whose "vars" are each variable's pickle (bytes).

Stdlib only, Python 3.8+: runs inside the machine (see ``agent.py``).
"""

import pickle
import struct

MAGIC = b"smolns2\n"
CHUNK = 1 << 20
DROPPED = 0xFFFFFFFF
# 5: a numpy array's data is written from its own memory (a PickleBuffer), not a copy of it
PROTOCOL = min(5, pickle.HIGHEST_PROTOCOL)
_HEAD = struct.Struct(">I")


def _pickler(fh):
    try:
        import cloudpickle  # shipped beside the agent; pickles cell-defined functions
    except ImportError:
        return pickle.Pickler(fh, protocol=PROTOCOL)
    return cloudpickle.CloudPickler(fh, protocol=PROTOCOL)


class _Writer:
    """A segment's chunks written into ``out``; an error of ``out`` kept, to tell it from a
    value that can't be pickled."""

    def __init__(self, out):
        self.out, self.failed = out, None

    def write(self, data):
        raw = getattr(data, "raw", None)  # a PickleBuffer: its bytes, as they are
        view = raw() if raw is not None else memoryview(data).cast("B")
        try:
            for i in range(0, view.nbytes, CHUNK):
                part = view[i:i + CHUNK]
                self.out.write(_HEAD.pack(part.nbytes))
                self.out.write(part)
        except OSError as exc:
            self.failed = exc
            raise
        return view.nbytes

    def end(self, whole=True):
        self.out.write(_HEAD.pack(0 if whole else DROPPED))


def dump(out, head, items):
    """Write the stream into ``out``: ``head`` (plain data), then each (name, value) of ``items``.
    Returns (the names saved, "name (error)" for each value that can't be pickled)."""
    seg = _Writer(out)
    out.write(MAGIC)
    pickle.Pickler(seg, protocol=PROTOCOL).dump(head)
    seg.end()
    saved, skipped = [], []
    for key, val in items:
        if not key:  # (an empty name ends the stream)
            continue
        seg.write(key.encode("utf-8", "surrogatepass"))
        seg.end()
        try:
            _pickler(seg).dump(val)
        except Exception as exc:
            if seg.failed is not None:  # the host stopped reading (the checkpoint limit): the save ends
                raise seg.failed from None
            seg.end(whole=False)
            skipped.append("%s (%s)" % (key, type(exc).__name__))
            continue
        seg.end()
        saved.append(key)
    seg.end()  # an empty name: the end
    out.flush()
    return saved, skipped


class _Reader:
    """One segment of ``fh`` as a file, for pickle.Unpickler."""

    def __init__(self, fh):
        self.fh, self.left, self.whole = fh, 0, None

    def _exact(self, n):
        data = self.fh.read(n)
        if len(data) != n:
            raise EOFError("the saved namespace ends in the middle of a variable")
        return data

    def _chunk(self):
        """Bytes left in this chunk (0 at the segment's end)."""
        if self.left == 0 and self.whole is None:
            (n,) = _HEAD.unpack(self._exact(_HEAD.size))
            if n in (0, DROPPED):
                self.whole = n == 0
            else:
                self.left = n
        return self.left

    def readinto(self, buf):
        view, done = memoryview(buf).cast("B"), 0
        while done < view.nbytes and self._chunk():
            got = self.fh.readinto(view[done:done + self.left])
            if not got:
                raise EOFError("the saved namespace ends in the middle of a variable")
            done += got
            self.left -= got
        return done

    def read(self, n=-1):
        if n is not None and 0 <= n <= self._chunk():  # within a chunk: no copy of it
            self.left -= n
            return self._exact(n)
        parts = []
        while (n is None or n < 0 or n > 0) and self._chunk():
            take = self.left if n is None or n < 0 else min(n, self.left)
            parts.append(self.read(take))
            n = n - take if n is not None and n >= 0 else n
        return b"".join(parts)

    def readline(self):
        line = b""
        while not line.endswith(b"\n"):
            c = self.read(1)
            if not c:
                break
            line += c
        return line

    def finish(self):
        """Skip what is left of the segment; whether it was whole."""
        while self._chunk():
            self.read(self.left)
        return self.whole


def load(fh):
    """(head, each (name, value, None) or (name, None, the exception unpickling it raised)) of
    what :func:`dump` wrote into ``fh`` (or the earlier layout's)."""
    start = fh.read(len(MAGIC))
    if start != MAGIC:
        data = pickle.Unpickler(_Prefixed(start, fh)).load()
        return data, ((k,) + _unpickled(lambda v=v: pickle.loads(v)) for k, v in data["vars"].items())
    head = _Reader(fh)
    data = pickle.Unpickler(head).load()
    head.finish()
    return data, _variables(fh)


def _variables(fh):
    while True:
        name = _Reader(fh)
        key = name.read().decode("utf-8", "surrogatepass")
        name.finish()
        if not key:
            return
        seg = _Reader(fh)
        got = _unpickled(pickle.Unpickler(seg).load)
        if seg.finish():  # (one whose pickling failed was not saved)
            yield (key,) + got
        del got


def _unpickled(load):
    try:
        return load(), None
    except Exception as exc:
        return None, exc


class _Prefixed:
    """``start`` (bytes read already), then the rest of ``fh``."""

    def __init__(self, start, fh):
        self.start, self.fh = start, fh

    def read(self, n=-1):
        if not self.start:
            return self.fh.read(n)
        head = self.start if n is None or n < 0 else self.start[:n]
        self.start = self.start[len(head):]
        rest = self.fh.read(-1 if n is None or n < 0 else n - len(head)) if n != len(head) else b""
        return head + rest

    def readline(self):
        if b"\n" in self.start:
            line, _, self.start = self.start.partition(b"\n")
            return line + b"\n"
        head, self.start = self.start, b""
        return head + self.fh.readline()
