"""Helpers the kernel starts on the host never import from the kernel's working folder.

The egress proxy runs as root until it drops to the sandbox uid. Started as ``python -m``
in the kernel's working folder, it put that folder first on ``sys.path``, ahead of the
standard library: a machine with a read-write volume over it (``volumes = [{ host = ".",
guest = "/project", readonly = false }]``) writes ``/project/ipaddress.py`` from a cell,
and the next proxy start runs it on the host as root. Here the planted module is put in
the working folder directly (what that cell does); it records that it ran and then loads
the real module, so the old start still works and only the record shows the attack. The
smol boot probe's ``python -c`` put the working folder first the same way.
"""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import pytest
from nethelpers import hello_handler

from smolbench.backends import probe

PLANT = r'''
import os, sys, sysconfig
with open({marker!r}, "a") as f:
    f.write("imported by uid=%d argv=%r\n" % (os.getuid(), sys.argv))
_p = os.path.join(sysconfig.get_paths()["stdlib"], {name!r} + ".py")
exec(compile(open(_p).read(), _p, "exec"), globals())
'''


def _plant(folder: Path, marker: Path, *names: str) -> None:
    for name in names:
        (folder / f"{name}.py").write_text(PLANT.format(marker=str(marker), name=name))


@pytest.mark.skipif(not __import__("shutil").which("bwrap"), reason="bubblewrap is not installed")
def test_the_proxy_imports_nothing_from_the_kernels_working_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from smolbench import Session

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), hello_handler(b"through the proxy"))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    work = tmp_path / "work"
    work.mkdir()
    marker = tmp_path / "ran-as-the-proxy"
    _plant(work, marker, "ipaddress", "argparse")  # both imported by the proxy before it drops
    (work / "Smolfile").write_text(f'[network]\nallow_cidrs = ["127.0.0.1/32:{port}"]\n')
    monkeypatch.chdir(work)
    monkeypatch.delenv("SMOLBENCH_TEST_WEAKEN", raising=False)
    try:
        with Session("Smolfile", backend="sandbox", ledger=str(tmp_path / "ledger.db")) as s:
            got = s.run("import urllib.request\n"
                        f"urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=60).read().decode()").value
    finally:
        server.shutdown()
        server.server_close()
    assert not marker.exists(), marker.read_text()
    assert got == "through the proxy"


def test_the_smol_probes_python_imports_nothing_from_the_working_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "ran-as-the-probe"
    _plant(tmp_path, marker, "json", "time")  # the probe's first imports
    monkeypatch.chdir(tmp_path)
    # the probe's own code, less the boot: smol must still import
    monkeypatch.setattr(probe, "_PROBE_CODE", "import json, sys, time\nimport smol\n"
                        "print('SMOLBENCH_PROBE ' + json.dumps({'ok': True, 'seconds': 0.5, 'argv': sys.argv[1:]}))")
    ok, reason, _ = probe._boot(60)
    assert not marker.exists(), marker.read_text()
    assert ok and "booted, ran `true` and was deleted in 0.5 s" in reason, reason
