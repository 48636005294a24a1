"""What the smol backend puts in a machine to run its agent: where it goes in the guest, the
launcher that starts it detached, the one exec that checks python3 and makes its folders, the
relay a request goes through, and the cloudpickle files copied in beside it."""

from __future__ import annotations

from pathlib import Path

GUEST_HOME = "/opt/smolbench"
GUEST_LIB = f"{GUEST_HOME}/lib"
GUEST_PACKAGES = "/opt/smolbench-packages"  # the Smolfile's packages: a read-only mount of the host's cache
GUEST_RUN = "/run/smolbench"
CLIENT = f"{GUEST_HOME}/client.py"
# Relays a request written to a file ($2): opened as stdin and removed before the
# relay starts, so nothing is left behind even when the relay is killed.
RELAY_FILE = 'exec 0<"$2" && rm -f "$2" && exec python3 "$0" "$1"'

# Starts the agent detached: output to a log (nobody reads the exec's pipes), its
# own session, and no parent-death signal (the launcher that execs it may exit
# first, which would kill it). The agent module is dropped from sys.modules so a
# user's own ``agent.py`` in the workdir still imports. If the agent dies, a
# ``.failed`` marker beside the log says so at once.
LAUNCHER = """\
import os, sys
home, log = sys.argv[1], sys.argv[2]
fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
os.dup2(fd, 1)
os.dup2(fd, 2)
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
try:
    os.setsid()
except OSError:
    pass
sys.path.insert(0, home)
import agent
sys.path.remove(home)
del sys.modules["agent"]
sys.argv = [agent.__file__] + sys.argv[3:] + ["--no-pdeathsig"]
try:
    agent.main(sys.argv[1:])
except BaseException:
    import traceback
    traceback.print_exc()
    open(os.path.splitext(log)[0] + ".failed", "w").close()
    raise
"""

# Checks python3 and makes the directories the agent needs, in one exec.
# Prints a guest file ($1) as base64 lines of 48 KiB each (the exec stream carries text), for
# the host to read as it comes and stop at its limit: never read whole in one reply.
READ_B64 = (
    "import base64, sys\n"
    "with open(sys.argv[1], 'rb') as f:\n"
    "    for b in iter(lambda: f.read(49152), b''):\n"
    "        sys.stdout.write(base64.b64encode(b).decode() + '\\n')\n"
)
# Prints the last $2 bytes of a guest file ($1), as text.
TAIL = (
    "import os, sys\n"
    "with open(sys.argv[1], 'rb') as f:\n"
    "    f.seek(max(0, os.fstat(f.fileno()).st_size - int(sys.argv[2])))\n"
    "    sys.stdout.write(f.read(int(sys.argv[2])).decode('utf-8', 'replace'))\n"
)

PREPARE = (
    "import os, sys\n"
    "for d in sys.argv[1:]:\n"
    "    os.makedirs(d, exist_ok=True)\n"
    "print('%d.%d' % sys.version_info[:2])\n"
)


def _cloudpickle_files() -> list[tuple[str, bytes]]:
    """(relative path, bytes) of every .py file of the installed cloudpickle package."""
    try:
        import cloudpickle
    except ImportError:
        return []
    root = Path(cloudpickle.__file__).resolve().parent
    return [
        (path.relative_to(root).as_posix(), path.read_bytes())
        for path in sorted(root.rglob("*.py"))
        if "__pycache__" not in path.parts
    ]
