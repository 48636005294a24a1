"""The JupyterLab extension as shipped: the committed build matches its sources, and a wheel
built with ``python -m build`` carries it so a fresh venv lists it (``-m slow``)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "labextension"
OUT = ROOT / "smolbench" / "labextension"


def _source_hash() -> str:
    """The same digest as labextension/scripts/stamp.js."""
    files = sorted(["package.json", "tsconfig.json", "install.json"]
                   + [f"src/{f}" for f in os.listdir(SRC / "src")] + [f"style/{f}" for f in os.listdir(SRC / "style")])
    h = hashlib.sha256()
    for f in files:
        h.update(f.encode() + b"\0" + (SRC / f).read_bytes() + b"\0")
    return h.hexdigest()


def test_the_committed_build_matches_its_sources() -> None:
    stamp = (OUT / "build-sources.sha256").read_text().strip()
    assert stamp == _source_hash(), "labextension/ changed since the last build: cd labextension && npm run build:prod"
    meta = json.loads((OUT / "package.json").read_text())
    assert meta["name"] == "smolbench" and meta["jupyterlab"]["_build"]["load"].startswith("static/remoteEntry.")
    assert (OUT / meta["jupyterlab"]["_build"]["load"]).is_file()


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a build, then every dependency from the index (its pip call alone may take 900 s)
def test_a_wheel_alone_installs_the_extension(tmp_path: Path) -> None:
    """python -m build, then a fresh venv with only that wheel (deps from the package index):
    `jupyter labextension list` shows smolbench enabled, and the server extension is on."""
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(ROOT)],
                   check=True, capture_output=True)
    wheel = next(dist.glob("jupyterlab_smolbench-*.whl"))
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    data = [n for n in names if ".data/data/share/jupyter/labextensions/smolbench/" in n]
    assert any(n.endswith("/package.json") for n in data) and any(n.endswith("/install.json") for n in data)
    assert any("/static/remoteEntry." in n for n in data)
    assert any(n.endswith("etc/jupyter/jupyter_server_config.d/smolbench.json") for n in names)
    assert not [n for n in names if n.startswith("smolbench/labextension/")]  # shipped once, not twice

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "JUPYTER_PATH")}
    env["HOME"] = str(tmp_path / "home")
    subprocess.run([str(py), "-m", "pip", "install", "-q", f"{wheel}[lab]"], check=True, env=env,
                   capture_output=True, timeout=900)
    out = subprocess.run([str(py), "-m", "jupyterlab.labextensions", "list"], env=env, capture_output=True,
                         text=True, check=True, cwd=tmp_path)
    text = out.stdout + out.stderr
    assert str(venv / "share" / "jupyter" / "labextensions") in text
    line = next(ln for ln in text.splitlines() if "smolbench" in ln)
    assert "enabled" in line and "OK" in line and "(python, jupyterlab-smolbench)" in line
    out = subprocess.run([str(py), "-m", "jupyter_server.extension.serverextension", "list"], env=env,
                         capture_output=True, text=True, check=True, cwd=tmp_path)
    assert "smolbench.server enabled" in " ".join((out.stdout + out.stderr).replace("\x1b[32m", "").replace("\x1b[0m", "").split())
    shutil.rmtree(venv)


@pytest.mark.slow
def test_an_editable_install_enables_both_extensions(tmp_path: Path) -> None:
    """`pip install -e .` (hatch editable + shared-data): `jupyter labextension list` shows
    smolbench enabled and the server extension is on, in a venv that sees this repo's deps."""
    import sysconfig

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    # This venv's packages (jupyterlab...), not the base interpreter's: nothing was installed
    # there by hand on a fresh machine. A path line in a .pth adds them after the new venv's own.
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    here = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(site) / "smolbench-test-deps.pth").write_text("".join(f"{d}\n" for d in here))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "JUPYTER_PATH")}
    env["HOME"] = str(tmp_path / "home")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)], check=True, env=env,
                   capture_output=True, timeout=600)
    out = subprocess.run([str(py), "-m", "jupyterlab.labextensions", "list"], env=env, capture_output=True,
                         text=True, check=True, cwd=tmp_path)
    text = out.stdout + out.stderr
    assert str(venv / "share" / "jupyter" / "labextensions") in text
    line = next(ln for ln in text.splitlines() if "smolbench" in ln)
    assert "enabled" in line and "OK" in line
    assert (venv / "etc" / "jupyter" / "jupyter_server_config.d" / "smolbench.json").is_file()
    code = "import smolbench; print(smolbench.__file__)"
    where = subprocess.run([str(py), "-c", code], env=env, capture_output=True, text=True, check=True, cwd=tmp_path)
    assert where.stdout.strip() == str(ROOT / "smolbench" / "__init__.py")  # editable: this tree
    shutil.rmtree(venv)
