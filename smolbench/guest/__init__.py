"""Code that runs inside a machine: the agent, its protocol, and a relay client.

Everything in this folder is stdlib-only Python 3.8+, because it runs on the
machine's own python3. The host ships these files into each machine.
"""

from __future__ import annotations

from pathlib import Path

GUEST_DIR = Path(__file__).resolve().parent
AGENT_FILES = ("agent.py", "protocol.py", "client.py", "contain.py", "seccomp.py", "mountguard.py", "uidshares.py", "pipsite.py")
