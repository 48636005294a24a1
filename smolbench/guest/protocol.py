"""The agent's wire protocol: one JSON object per line, both ways.

Stdlib only: this module runs inside the machine (Python 3.8+) as well as on
the host, so the protocol tested on the sandbox is the one a microVM speaks.

Requests (host -> agent), one per connection::

    {"op": "exec", "code": "...", "cell": "<cell-3>", "push": {name: b64}, "pull": [names]}
    {"op": "fork", "children": [{"name": "root.0", "seed": 7, "socket": "/run/..."}]}
    {"op": "seed", "seed": 7}            # apply a seed (used after a microVM branch)
    {"op": "ping"} | {"op": "interrupt"} | {"op": "kill", "pid": 123} | {"op": "shutdown"}
    {"op": "save", "path": "..."} | {"op": "load", "path": "..."}

Replies (agent -> host), several per request, the last one has ``"t": "done"``::

    {"t": "stream", "name": "stdout", "text": "..."}
    {"t": "display", "data": {mime: value}}
    {"t": "done", "status": "ok" | "error", "result": {...} | null,
     "error": {"ename", "evalue", "traceback": [...]} | null,
     "pulled": {name: b64}, "reward": float | null, "metrics": {...}, ...}
"""

import base64
import json

VERSION = 1
ENCODING = "utf-8"


def encode(msg):
    """One message as a line of bytes."""
    return (json.dumps(msg, default=repr, separators=(",", ":")) + "\n").encode(ENCODING)


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
