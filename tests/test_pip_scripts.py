"""Scripts ``pip`` writes in a machine name no path of the host (the saved workspace goes out).

The attack (session 33's known gap): a ``%pip install`` of a package with a console script
wrote ``.packages/bin/TOOL`` beginning ``#!<the interpreter's path>``; under the sandbox that
is the host's Python (``/home/teacher/.venv/bin/python``), so every saved or exported
workspace carried the teacher's path, and a student's machine restored from it could not run
the script. Now each script that names the interpreter finds it when it runs (pip's shims do
the same), whether pip ran from a ``%pip`` line or as the ``pip`` command.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import smolbench
from smolbench.backends.base import CellRequest
from smolbench.backends.sandbox import SandboxBackend
from smolbench.guest import pipsite
from smolbench.ledger import Ledger
from smolbench.spec import MachineSpec
from smolbench.workbench import Workbench

# A cell that makes a wheel with a console script and installs it, two ways (%pip, then the
# `pip` command on PATH), and says what each script's first line names and what it prints.
INSTALL = r'''
import os, subprocess, sys, zipfile, base64, hashlib, json
def wheel(name):
    path = f"/tmp/{name}-1.0-py3-none-any.whl"
    files = {f"{name}.py": "def main():\n    print('{name} ran')\n".replace("{name}", name),
             f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{name}-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
             f"{name}-1.0.dist-info/entry_points.txt": f"[console_scripts]\n{name}-tool = {name}:main\n"}
    record = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d.encode()).digest()).rstrip(b'=').decode()},{len(d)}"
              for n, d in files.items()] + [f"{name}-1.0.dist-info/RECORD,,"]
    with zipfile.ZipFile(path, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr(f"{name}-1.0.dist-info/RECORD", "\n".join(record) + "\n")
    return path
out = {}
def seen(name):
    script = os.path.join(os.environ["PIP_TARGET"], "bin", name + "-tool")
    with open(script) as fh:
        head = fh.read().split("\n")[:3]
    ran = subprocess.run([name + "-tool"], capture_output=True, text=True)
    out[name] = {"head": head, "ran": ran.stdout.strip(), "err": ran.stderr.strip()[-300:]}
subprocess.run(["pip", "install", "-q", "--no-index", wheel("beta")], check=True)
seen("beta")
# pip --target leaves an existing bin/ as it is unless told to replace it
%pip install -q --no-index --upgrade {wheel("alpha")}
seen("alpha")
print(json.dumps(out))
'''


def test_portable_scripts_rewrites_both_of_pips_forms_and_nothing_else(tmp_path: Path) -> None:
    exe = sys.executable
    body = "import sys\nprint('ran', sys.argv[1:])\n"
    scripts = {"plain": f"#!{exe}\n{body}", "long": f"#!/bin/sh\n'''exec' {exe} \"$0\" \"$@\"\n' '''\n{body}",
               "quoted": f"#!\"{exe}\"\n{body}", "other": f"#!/usr/bin/env python3\n{body}"}
    for name, text in scripts.items():
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    pipsite.portable_scripts(str(tmp_path), exe)
    env = {"PATH": os.environ.get("PATH", ""), pipsite.PYTHON_ENV: exe}
    for name in scripts:
        text = (tmp_path / name).read_text()
        assert exe not in text if name != "other" else text == scripts[name], text
        assert text.endswith(body) and os.access(tmp_path / name, os.X_OK)
        done = subprocess.run([str(tmp_path / name), "a b"], env=env, capture_output=True, text=True, timeout=60)
        assert done.stdout == "ran ['a b']\n", done.stderr


def test_a_scripts_coding_line_stays_where_python_reads_it_and_no_link_is_followed(tmp_path: Path) -> None:
    """The second audit: a latin-1 script's coding line moved to line 5, where Python no longer
    reads it (it printed café, then failed to start); the new file was opened through a link a
    cell planted at its name, writing where the link pointed."""
    exe = sys.executable
    (tmp_path / "latin").write_bytes(f"#!{exe}\n# -*- coding: latin-1 -*-\nprint('caf\xe9')\n".encode("latin-1"))
    (tmp_path / "linked").write_text(f"#!{exe}\nprint('linked')\n")
    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    (tmp_path / "linked.portable").symlink_to(victim)
    for name in ("latin", "linked"):
        (tmp_path / name).chmod(0o755)
    pipsite.portable_scripts(str(tmp_path), exe)
    env = {"PATH": os.environ.get("PATH", ""), pipsite.PYTHON_ENV: exe, "PYTHONIOENCODING": "utf-8"}
    done = subprocess.run([str(tmp_path / "latin")], env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout == "caf\u00e9\n" and exe not in (tmp_path / "latin").read_bytes().decode("latin-1"), done.stderr
    assert victim.read_text() == "untouched\n" and (tmp_path / "linked.portable").is_symlink()
    assert not (tmp_path / "linked").is_symlink()


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
def test_scripts_pip_writes_in_a_machine_name_no_host_path_and_run(open_tmp: Path) -> None:
    wb = Workbench(SandboxBackend(), MachineSpec(), Ledger(open_tmp / "ledger.db"))

    async def main() -> str:
        await wb.up()
        try:
            res = await wb.backend.exec_cell(wb.require_up(), CellRequest(INSTALL), lambda e: None)
            assert res.status == "ok", (res.error, res.stderr)
            return res.stdout
        finally:
            await wb.down()

    out = json.loads(asyncio.run(asyncio.wait_for(main(), 240)).strip().splitlines()[-1])
    for name in ("alpha", "beta"):
        head = "\n".join(out[name]["head"])
        assert sys.executable not in head and sys.prefix not in head and "python" in head, head
        assert out[name]["ran"] == f"{name} ran", out[name]


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
def test_scripts_a_cells_own_python_m_pip_wrote_name_no_host_path_in_a_saved_checkpoint(open_tmp: Path) -> None:
    # neither %pip nor the pip shim: the interpreter's own pip, which smolbench never sees run
    cell = INSTALL.split("out = {}")[0] + (
        'subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", wheel("gamma")], check=True)\n')
    with smolbench.Session(backend="sandbox", ledger=open_tmp / "ledger.db") as s:
        s.run(cell)
        saved = Path(s.checkpoint_save("g")["path"])
        ran = s.run("import subprocess; print(subprocess.run(['gamma-tool'], capture_output=True, text=True).stdout)")
    with tarfile.open(saved) as outer:
        inner = outer.extractfile("workspace.tar")
        assert inner is not None
        with tarfile.open(fileobj=io.BytesIO(inner.read())) as ws:
            script = ws.extractfile(".packages/bin/gamma-tool")
            assert script is not None
            head = script.read().decode().split("\n")[:3]
    assert "python" in "\n".join(head) and not any(sys.prefix in line for line in head), head
    assert ran.stdout.strip() == "gamma ran"  # and it still runs, in the machine that saved it
