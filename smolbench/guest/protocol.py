"""The agent's wire protocol: one JSON object per line, both ways.

Stdlib only: this module runs inside the machine (Python 3.8+) as well as on
the host, so the protocol tested on the sandbox is the one a microVM speaks.

Requests (host -> agent), one per connection::

    {"op": "exec", "id": 17, "code": "...", "cell": "<cell-3>", "push": {name: b64}, "pull": [names]}
    {"op": "fork", "children": [{"name": "root.0", "seed": 7, "socket": "/run/..."}], "hold": true}
    {"op": "release", "go": true}        # held children of the last fork: start (or exit)
    {"op": "warm"}                       # before a microVM branch: import and freeze what branches share
    {"op": "seed", "seed": 7}            # apply a seed (used after a microVM branch)
    {"op": "ping"} | {"op": "kill", "pid": 123} | {"op": "shutdown"}
    {"op": "interrupt", "id": 17}        # stops the exec or save of that id if it runs (no id: any)
    {"op": "save", "id": 18, "path": "..."} | {"op": "load", "path": "..."}

Replies (agent -> host), several per request, the last one has ``"t": "done"``::

    {"t": "stream", "name": "stdout", "text": "..."}
    {"t": "display", "data": {mime: value}}
    {"t": "done", "status": "ok" | "error", "result": {...} | null,
     "error": {"ename", "evalue", "traceback": [...]} | null,
     "pulled": {name: {"format": "data", "data": tree} | {"format": "refused", "type": "mod.Cls"}
                      | {"format": "pickle", "data": b64}},   # pickle only when pull_trusted
     "reward": float | null, "metrics": {...}, ...}
    {"t": "answer", "value": {"format": "data", ...}} | {"t": "answer", "error": {...}}
        # a cell serving a kept channel (``smolbench_guest.channel()``): one per request
        # line the host sends on the same connection after the cell's own

The host decodes replies only through ``smolbench.gate``, which trusts none of this.
"""

import base64
import json

VERSION = 1
ENCODING = "utf-8"
CHANNEL_LINE = 1024 * 1024  # bytes of one request line on a cell's kept channel at most (the guest reads no more)


def encode(msg):
    """One message as a line of bytes (strict JSON: non-finite floats become strings)."""
    try:
        text = json.dumps(msg, default=repr, separators=(",", ":"), allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(msg), default=repr, separators=(",", ":"), allow_nan=False)
    return (text + "\n").encode(ENCODING)


def _finite(value):
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return repr(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def decode(line):
    """One line of bytes (or str) back into a message."""
    if isinstance(line, bytes):
        line = line.decode(ENCODING)
    return json.loads(line)


def b64(data):
    """Bytes as ASCII text for a JSON message."""
    return base64.b64encode(data).decode("ascii")


def unb64(text):
    """ASCII text from a JSON message back into bytes."""
    return base64.b64decode(text.encode("ascii"))
