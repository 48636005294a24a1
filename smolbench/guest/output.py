"""A cell's output: MIME bundles for values, and stdout/stderr batched to the host.

Stdlib only, Python 3.8+: runs inside the machine (see ``agent.py``).
"""

import io
import itertools
import os
import sys
import threading
import time

from . import protocol as P

MIME_METHODS = (
    ("text/html", "_repr_html_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("text/markdown", "_repr_markdown_"),
    ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"),
    ("application/javascript", "_repr_javascript_"),  # sent as it is: the host's gate drops it, with a note
)
BUNDLE_TYPES = 64  # MIME types taken from one _repr_mimebundle_ at most
OUTPUT_KEEP = 64 * 1024  # characters of stdout/stderr kept for the result record
BATCH_CHARS = 64 * 1024  # stream text sent per message at most
BATCH_SECONDS = 0.005  # how long output gathers before it is sent


PLOTLY_MIME = "application/vnd.plotly.v1+json"


def _plotly_json(value):
    # A plotly figure as JSON data (its HTML form is a script, which the host won't show).
    to_json = getattr(value, "to_json", None)
    if to_json is None or not hasattr(value, "to_plotly_json") or isinstance(value, type):
        return None
    try:
        import json

        return json.loads(to_json())
    except Exception:
        return None


def mime_bundle(value):
    """A Jupyter MIME bundle for ``value`` (text/plain always present)."""
    data = {}
    fig = _plotly_json(value)
    if fig is not None:
        data[PLOTLY_MIME] = fig
    else:  # as IPython's formatter: what _repr_mimebundle_ gives first, the other methods fill in
        data.update(_repr_mimebundle(value))
    for mime, meth in MIME_METHODS:
        if (fig is not None and mime == "text/html") or mime in data:
            continue
        fn = getattr(value, meth, None)
        if fn is None or isinstance(value, type):
            continue
        try:
            out = fn()
        except Exception:
            continue
        if out is None:
            continue
        if isinstance(out, tuple):  # (data, metadata)
            out = out[0]
        if isinstance(out, bytes):
            out = P.b64(out)
        data[mime] = out
    if "matplotlib" in sys.modules and "image/png" not in data:
        from . import figures  # (only once the cell's code imported matplotlib)

        if figures.is_figure(value):
            try:
                image = figures.png(value)
            except Exception:
                image = None
            if image is not None:
                data["image/png"] = P.b64(image)
    if isinstance(data.get("text/plain"), str):
        return data
    try:
        data["text/plain"] = repr(value)
    except Exception as exc:  # a broken __repr__ must not lose the cell
        data["text/plain"] = "<unrepresentable %s: %s>" % (type(value).__name__, exc)
    return data


def _repr_mimebundle(value):
    fn = getattr(value, "_repr_mimebundle_", None)
    if fn is None or isinstance(value, type):
        return {}
    try:
        try:
            out = fn(include=None, exclude=None)
        except TypeError:
            out = fn()
    except Exception:
        return {}
    if isinstance(out, tuple) and out:  # (data, metadata)
        out = out[0]
    return raw_bundle(out) or {}


def raw_bundle(obj):
    """A MIME bundle given as a dict (``_repr_mimebundle_``, ``display(..., raw=True)``): at most
    ``BUNDLE_TYPES`` types, each text, bytes (sent as base64) or JSON data; None if not a dict.
    What the host may show of it is the gate's to say."""
    if not isinstance(obj, dict):
        return None
    data = {}
    for mime, val in itertools.islice(obj.items(), BUNDLE_TYPES):
        if not isinstance(mime, str) or not mime or len(mime) > 255:
            continue
        if isinstance(val, (bytes, bytearray)):
            val = P.b64(bytes(val))
        elif not isinstance(val, (str, dict, list)):
            continue
        data[mime] = val
    return data


class _Outbox:
    """Batches a cell's stream output: one message per ~5 ms or 64 KiB, not one per print.

    Writers append; a flusher thread sends what has gathered. A writer that gets
    far ahead of the host (its socket full) sends itself, so it waits for the host
    instead of buffering without bound.
    """

    def __init__(self, agent):
        self._agent = agent
        self._parts = []  # [name, [texts]] in order
        self._size = 0
        self._lock = threading.Lock()
        self._sending = threading.Lock()
        self._wake = threading.Event()
        self._pid = None

    def write(self, name, text):
        if self._pid != os.getpid():  # a new process (a branch): its own flusher thread
            self._pid = os.getpid()
            threading.Thread(target=self._flusher, daemon=True).start()
        with self._lock:
            if self._parts and self._parts[-1][0] == name:
                self._parts[-1][1].append(text)
            else:
                self._parts.append([name, [text]])
            self._size += len(text)
            big = self._size >= BATCH_CHARS
        if big:
            self.flush()
        else:
            self._wake.set()

    def flush(self):
        # One flush at a time, whole: whatever a flush took is sent before another (or the
        # cell's final reply, which follows a flush) can go.
        with self._sending:
            with self._lock:
                parts, self._parts, self._size = self._parts, [], 0
            for name, texts in parts:
                text = "".join(texts)
                for i in range(0, len(text), BATCH_CHARS):  # a huge write goes in bounded frames
                    self._agent.send({"t": "stream", "name": name, "text": text[i:i + BATCH_CHARS]})

    def _flusher(self):
        me = os.getpid()
        while os.getpid() == me:
            self._wake.wait()
            time.sleep(BATCH_SECONDS)
            self._wake.clear()
            try:
                self.flush()
            except Exception:  # the host went away: the cell goes on
                pass


class _Stream(io.TextIOBase):
    """sys.stdout / sys.stderr replacement that streams writes to the host (batched)."""

    def __init__(self, agent, name):
        self._agent = agent
        self.name = name

    def writable(self):
        return True

    def write(self, text):
        if not isinstance(text, str):
            raise TypeError("write() argument must be str, not %s" % type(text).__name__)
        n = len(text)
        if text and not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate (e.g. a non-UTF-8 file name): shown escaped,
                text = text.encode("utf-8", "backslashreplace").decode("utf-8")  # as Python's stderr does
        if text:
            self._agent.stream(self.name, text)
        return n

    def flush(self):
        self._agent.outbox.flush()

    def isatty(self):
        return False

