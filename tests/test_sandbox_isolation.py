"""The sandbox backend's isolation, on the real bubblewrap sandbox (no mocks)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from smolbench import _loop
from smolbench.backends import sandbox
from smolbench.backends.base import CellRequest, CellResult, MachineRef
from smolbench.backends.process import ProcessBackend
from smolbench.backends.sandbox import SandboxBackend
from smolbench.errors import BackendUnavailable
from smolbench.images import build_debian_rootfs, image_dir
from smolbench.smolfile import parse_smolfile
from smolbench.spec import MachineSpec

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")


@pytest.fixture
def backend() -> Iterator[SandboxBackend]:
    b = SandboxBackend()
    try:
        yield b
    finally:
        _loop.run(b.close())
        assert b.list() == []


def up(b: SandboxBackend, spec: MachineSpec | None = None, name: str = "root") -> MachineRef:
    return _loop.run(b.create(spec or MachineSpec(), name))


def run(b: SandboxBackend, ref: MachineRef, code: str) -> CellResult:
    res = _loop.run(b.exec_cell(ref, CellRequest(code), lambda e: None))
    assert res.status == "ok", res.error
    return res


def value(res: CellResult) -> str:
    assert res.result is not None
    return str(res.result["text/plain"])


NET_PROBE = (
    "import socket\n"
    "def reach(host, port):\n"
    "    try:\n"
    "        socket.create_connection((host, port), timeout=2).close(); return 'reached'\n"
    "    except OSError as exc:\n"
    "        return type(exc).__name__\n"
)


def test_the_network_is_unreachable_unless_asked(backend: SandboxBackend) -> None:
    import socket
    import threading

    # A server on the host's loopback: reachable from the host, not from the machine.
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    threading.Thread(target=lambda: srv.accept(), daemon=True).start()
    try:
        ref = up(backend)
        res = run(backend, ref, NET_PROBE + f"(reach('127.0.0.1', {port}), reach('1.1.1.1', 53))")
        assert "reached" not in value(res)
        assert "OSError" in value(res) or "ConnectionRefusedError" in value(res)
        # network on: still never the host's own loopback (tests/test_netpolicy.py has the rest) ...
        netref = up(backend, MachineSpec(net=True), name="netted")
        res = run(backend, netref, NET_PROBE + f"reach('127.0.0.1', {port})")
        assert "reached" not in value(res)
        # ... unless it is listed by address and port
        listed = up(backend, MachineSpec(allow_cidrs=(f"127.0.0.1/32:{port}",)), name="listed")
        res = run(backend, listed, NET_PROBE + f"reach('127.0.0.1', {port})")
        assert value(res) == "'reached'"
    finally:
        srv.close()


def test_the_host_home_and_private_paths_are_hidden(backend: SandboxBackend, tmp_path: Path) -> None:
    home = Path.home()
    secret = home / ".smolbench-test-secret"
    secret.write_text("do not read")
    try:
        ref = up(backend)
        # The notebook's own Python is bound in (it may live in a project folder); the project isn't.
        project = Path(__file__).resolve().parent.parent
        res = run(backend, ref, f"import os\n(os.path.exists({str(secret)!r}), os.path.exists({str(tmp_path)!r}), "
                                f"os.path.exists({str(project / 'smolbench')!r}), os.path.exists('/etc/shadow'))")
        assert value(res) == "(False, False, False, False)"
        # writing to the system is refused: the host's system is mounted read-only
        res = _loop.run(backend.exec_cell(ref, CellRequest("open('/usr/smolbench-was-here', 'w')"), lambda e: None))
        assert res.status == "error" and res.error is not None and res.error["ename"] == "OSError"
        assert not Path("/usr/smolbench-was-here").exists()
    finally:
        secret.unlink()


def test_declared_volumes_are_the_only_host_mounts(backend: SandboxBackend, open_tmp: Path) -> None:
    tmp_path = open_tmp
    data = tmp_path / "data"
    data.mkdir()
    (data / "level.txt").write_text("level-3")
    spec = parse_smolfile('[[volumes]]\nhost = "data"\nguest = "/data"\n', base_dir=str(tmp_path))
    ref = up(backend, spec)
    assert value(run(backend, ref, "open('/data/level.txt').read()")) == "'level-3'"
    res = _loop.run(backend.exec_cell(ref, CellRequest("open('/data/new.txt', 'w')"), lambda e: None))
    assert res.status == "error"  # read-only unless the Smolfile says readonly = false


def test_a_branch_write_is_invisible_to_its_siblings_and_parent(backend: SandboxBackend) -> None:
    ref = up(backend)
    run(backend, ref, "open('shared.txt', 'w').write('parent')\nopen('/tmp/t.txt', 'w').write('parent')\nwarm = 'state'")
    kids = _loop.run(backend.branch(ref, ["root.0", "root.1"], [0, 1]))
    run(backend, kids[0], "open('shared.txt', 'w').write('child0')\nopen('/tmp/t.txt', 'w').write('child0')\nopen('new.txt', 'w').write('x')\nwarm = 'changed'")
    seen = value(run(backend, kids[1], "import os\n(open('shared.txt').read(), open('/tmp/t.txt').read(), os.path.exists('new.txt'), warm, SEED)"))
    assert seen == "('parent', 'parent', False, 'state', 1)"
    seen = value(run(backend, ref, "import os\n(open('shared.txt').read(), open('/tmp/t.txt').read(), os.path.exists('new.txt'), warm)"))
    assert seen == "('parent', 'parent', False, 'state')"
    assert value(run(backend, kids[0], "(open('shared.txt').read(), warm, SEED)")) == "('child0', 'changed', 0)"


def test_deleting_a_machine_leaves_no_process(backend: SandboxBackend) -> None:
    ref = up(backend)
    kids = _loop.run(backend.branch(ref, ["root.0", "root.1"], [0, 1]))
    pid = ref.info["pid"]
    _loop.run(backend.delete(kids[0]))
    assert value(run(backend, kids[1], "1")) == "1"
    _loop.run(backend.delete(ref))
    assert not Path(f"/proc/{pid}").exists()
    assert not Path(ref.info["run_dir"]).exists()
    assert backend.list() == []


def test_the_process_backend_is_a_plain_process_and_says_so() -> None:
    b = ProcessBackend()
    assert b.name == "process" and b.isolation.startswith("NONE")
    try:
        ref = up(b)
        assert value(run(b, ref, "import os\nos.getpid() > 1")) == "True"
        kids = _loop.run(b.branch(ref, ["root.0"], [7]))
        assert value(run(b, kids[0], "SEED")) == "7"
    finally:
        _loop.run(b.close())


def test_the_sandbox_backend_without_bwrap_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    with pytest.raises(BackendUnavailable, match="^the sandbox backend needs bubblewrap, which is not installed: `apt-get install bubblewrap`"):
        SandboxBackend()


@pytest.fixture(scope="session")
def debian_rootfs() -> Path:
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        pytest.skip("building a Debian rootfs needs root and debootstrap (apt-get install debootstrap)")
    return build_debian_rootfs("debian:bookworm", log=lambda *a: None)


def test_a_pinned_debian_rootfs_from_the_smolfile(backend: SandboxBackend, debian_rootfs: Path, tmp_path: Path) -> None:
    assert debian_rootfs == image_dir("debian:bookworm")
    spec = parse_smolfile('image = "debian:bookworm"\n', base_dir=str(tmp_path))
    ref = up(backend, spec)
    res = run(backend, ref, "import sys, platform\n(sys.executable, open('/etc/debian_version').read().strip()[:2])")
    assert value(res) == "('/usr/bin/python3', '12')"
    # cloudpickle travels with the agent, so notebook functions can be pushed in
    import cloudpickle

    fn = cloudpickle.dumps(lambda v: v + 1)
    res = _loop.run(backend.exec_cell(ref, CellRequest("out = f(41)\nout", push={"f": fn}), lambda e: None))
    assert res.status == "ok" and res.result is not None and res.result["text/plain"] == "42"


VENV_PROBE = """
import json, sys
from smolbench import _loop
from smolbench.backends.base import CellRequest
from smolbench.backends.sandbox import SandboxBackend
from smolbench.spec import MachineSpec
b = SandboxBackend()
try:
    ref = _loop.run(b.create(MachineSpec(), "root"))
    code = "import sys, os\\nopen('/tmp/mine.txt', 'w').write('x')\\n(sys.prefix, os.path.exists('/tmp/mine.txt'))"
    root = _loop.run(b.exec_cell(ref, CellRequest(code), lambda e: None)).result
    kid = _loop.run(b.branch(ref, ["root.0"], [1]))[0]
    branch = _loop.run(b.exec_cell(kid, CellRequest("import sys, os\\n(sys.prefix, os.path.exists('/tmp/mine.txt'))"), lambda e: None)).result
    print(json.dumps([root["text/plain"], branch["text/plain"]]))
finally:
    _loop.run(b.close())
"""


def test_a_notebook_python_under_tmp_is_not_hidden_by_the_machines_tmp(open_tmp: Path) -> None:
    """CI and Binder often keep the kernel's venv under /tmp, which the machine's own /tmp covers."""
    import json
    import subprocess
    import sys
    import sysconfig

    venv = open_tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    here = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{here}{os.pathsep}{sysconfig.get_paths()['purelib']}"}
    out = subprocess.run([str(venv / "bin" / "python"), "-c", VENV_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    root, branch = json.loads(out.stdout.strip().splitlines()[-1])
    assert root == f"({str(venv)!r}, True)" and branch == f"({str(venv)!r}, True)"


def test_many_forks_with_writes_flatten_the_layers_once_and_say_so(backend: SandboxBackend) -> None:
    """Each fork after a write stacks a layer; past overlayfs' comfortable depth a fork copies
    them into one, and `%smol status` (the backend's isolation line) says so."""
    ref = up(backend)
    for i in range(52):
        run(backend, ref, f"open('f{i}.txt', 'w').write('{i}')")
        kid = _loop.run(backend.branch(ref, [f"root.{i}"], [i]))[0]
        if i in (0, 51):
            assert value(run(backend, kid, "import os\nlen([f for f in os.listdir() if f.endswith('.txt')])")) == str(i + 1)
        _loop.run(backend.delete(kid))
    assert "flattened" in backend.isolation
    assert value(run(backend, ref, "import os\nsorted(f for f in os.listdir() if not f.startswith('.')) == sorted(f'f{i}.txt' for i in range(52))")) == "True"
