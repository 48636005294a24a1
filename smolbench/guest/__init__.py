"""Code that runs inside a machine: the agent, its protocol, and a relay client.

Everything in this folder is stdlib-only Python 3.8+, because it runs on the
machine's own python3. The host ships these files into each machine.
"""

from __future__ import annotations

from pathlib import Path

GUEST_DIR = Path(__file__).resolve().parent
# Every module here but this one: the agent imports its siblings as a package of their own (agent.py).
AGENT_FILES = tuple(sorted(p.name for p in GUEST_DIR.glob("*.py") if p.name != "__init__.py"))
