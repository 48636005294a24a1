"""A hostile cell can't get out of the sandbox (issue 8), tried from `%%smol` cells in a real kernel.

Every attack runs twice: in the real sandbox, where it must fail, and in a deliberately
weakened one (``SMOLBENCH_TEST_WEAKEN``: ``host-root`` restores the old bwrap
``--uid 0 --cap-add CAP_SYS_ADMIN`` set-up with the whole host /etc and /var and no
per-machine namespaces; ``seccomp`` leaves out the seccomp filter), where the same probe
must see the escape. So each check is shown able to fail. Writes only ever target this
test's own folders (bound in as a read-only volume), never the host's system.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nbhelpers import NotebookSession, error_text, result_text
from sockethelpers import host_socket

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")

AS_ROOT = os.geteuid() == 0
DISK_MIB = 64

# Loaded once into each machine; every probe returns plain data.
PROBES = r'''
import ctypes, errno, json, os, socket, subprocess, time
_libc = ctypes.CDLL(None, use_errno=True)
MS_REMOUNT, MS_BIND = 32, 4096

def _mount(src, tgt, fs, flags, data=None):
    return _libc.mount(src and src.encode(), tgt.encode(), fs and fs.encode(), ctypes.c_ulong(flags), data and data.encode()) == 0

def _write(path):
    try:
        with open(path, "w") as fh:
            fh.write("escaped")
        return True
    except OSError:
        return False

def remount_rw_and_write(targets):
    """Remount read-only binds read-write, then write into them."""
    out = {}
    for t in targets:
        _mount(None, t, None, MS_REMOUNT | MS_BIND)  # no MS_RDONLY: read-write
        out[t] = _write(os.path.join(t, "probe-remount"))
    return out

def write_plain(targets):
    return {t: _write(os.path.join(t, "probe-plain")) for t in targets}

def read(path):
    try:
        with open(path) as fh:
            return fh.read()[:40]
    except OSError as exc:
        return errno.errorcode.get(exc.errno, "error")

def identity():
    st = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
    return {"uid": os.getuid(), "cap_eff": int(st["CapEff"].strip(), 16), "no_new_privs": st["NoNewPrivs"].strip(),
            "seccomp": st["Seccomp"].strip(), "etc": sorted(os.listdir("/etc")),
            "var": sorted(os.listdir("/var")) if os.path.isdir("/var") and not os.path.islink("/var/tmp") else "only /var/tmp -> /tmp",
            "opt": os.path.exists("/opt")}

def direct_mounts():
    """Mount without making a user namespace first: needs capabilities in the machine's own."""
    os.makedirs("/tmp/probe-mnt", exist_ok=True)
    tmpfs = _mount("tmpfs", "/tmp/probe-mnt", "tmpfs", 0)
    proc = _mount("proc", "/tmp/probe-mnt", "proc", 0)
    return {"tmpfs": tmpfs, "proc": proc}

def ptrace_own_child():
    pid = os.fork()
    if pid == 0:
        time.sleep(10)
        os._exit(0)
    ok = _libc.ptrace(16, pid, 0, 0) == 0  # PTRACE_ATTACH
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return ok

def host_pid(pid):
    """Can this machine see or signal a host process?"""
    try:
        os.kill(pid, 0)
        signalled = True
    except OSError:
        signalled = False
    return {"signal": signalled, "proc": os.path.exists("/proc/%d/cmdline" % pid)}

def reach(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False

def in_new_userns(script):
    """Run a shell script as root of a fresh user + mount namespace (`unshare -r -m`)."""
    res = subprocess.run(["unshare", "-r", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=30)
    return {"rc": res.returncode, "out": res.stdout.split(), "err": res.stderr[-300:]}

def sibling_files(marker, workdir="/workspace"):
    """Look for a sibling's file through /proc/<pid>/root."""
    found = []
    for p in os.listdir("/proc"):
        if p.isdigit() and int(p) != os.getpid():
            try:
                if marker in os.listdir("/proc/%s/root%s" % (p, workdir)):
                    found.append(int(p))
            except OSError:
                pass
    return found

def _ask(path, msg):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(path)
    s.sendall(json.dumps(msg).encode() + b"\n")
    data = b""
    while True:
        part = s.recv(65536)
        if not part:
            break
        data += part
    s.close()
    return [json.loads(l) for l in data.splitlines() if l.strip()]

def foreign_agents(me, code):
    """Find agent sockets of other machines and run ``code`` there."""
    ran = []
    for top in ("/run", "/tmp", "/workspace", "/dev/shm"):
        for folder, dirs, files in os.walk(top):
            for f in files:
                path = os.path.join(folder, f)
                try:
                    info = _ask(path, {"op": "ping"})[-1]["info"]
                except Exception:
                    continue
                if info.get("name") != me:
                    done = _ask(path, {"op": "exec", "code": code})[-1]
                    ran.append((info.get("name"), done.get("status")))
    return ran

def fill_disk(mib):
    chunk = b"\0" * (1 << 20)
    written = 0
    try:
        with open("/workspace/fill", "wb") as fh:
            for _ in range(mib):
                fh.write(chunk)
                fh.flush()
                written += 1
        return {"written": written, "error": None}
    except OSError as exc:
        return {"written": written, "error": errno.errorcode.get(exc.errno)}
    finally:
        try:
            os.unlink("/workspace/fill")
        except OSError:
            pass
'''


class Lab:
    """A kernel with a machine up and two kept branches (root.0, root.1), plus host bait."""

    def __init__(self, base: Path, weaken: str, net: bool = False) -> None:
        self.base = base
        self.ro = base / "ro"  # bound read-only into the machines; holds a root-only secret
        self.ro.mkdir()
        self.ro.chmod(0o755)
        (self.ro / "public.txt").write_text("public")
        self.secret = self.ro / "secret.txt"
        self.secret.write_text("host secret")
        self.secret.chmod(0o600)
        (base / "Smolfile").write_text(f'disk = "{DISK_MIB}M"\n[[volumes]]\nhost = "ro"\nguest = "/ro"\nreadonly = true\n')
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(8)
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()
        self.sleeper = subprocess.Popen(["sleep", "600"])
        old = os.environ.get("SMOLBENCH_TEST_WEAKEN")
        os.environ["SMOLBENCH_TEST_WEAKEN"] = weaken
        try:
            self.nb = NotebookSession(base, allow_errors=True).__enter__()
        finally:
            if old is None:
                os.environ.pop("SMOLBENCH_TEST_WEAKEN", None)
            else:
                os.environ["SMOLBENCH_TEST_WEAKEN"] = old
        self.ok("%load_ext smolbench")
        self.ok("%smol up --backend sandbox" + (" --net" if net else ""))
        self.ok("%%smol\n" + PROBES)
        self.ok("%%smol fork 2 --keep all --quiet\nimport smolbench_guest\nopen('sibling-' + smolbench_guest.node, 'w').write('x')")

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            conn.close()

    def ok(self, source: str) -> Any:
        cell = self.nb.run(source)
        err = error_text(cell)
        assert not err, f"{source[:60]!r} raised:\n{err}"
        return cell

    def probe(self, expr: str, node: str = "root") -> Any:
        """Evaluate ``expr`` in machine ``node``; its value (JSON-able) comes back."""
        self.ok(f"%smol use {node}")
        self.ok(f"%%smol --pull out\nimport json\nout = json.dumps({expr})")
        value = result_text(self.ok("out"))
        assert value is not None
        return json.loads(ast.literal_eval(value))  # the repr of a str

    def close(self) -> None:
        try:
            self.nb.__exit__(None, None, None)
        finally:
            self.server.close()
            self.sleeper.kill()
            self.sleeper.wait()


def _lab(weaken: str, net: bool = False) -> Iterator[Lab]:
    base = Path(tempfile.mkdtemp(prefix="smolbench-contain-"))
    base.chmod(0o711)
    try:
        lab = Lab(base, weaken, net)
        try:
            yield lab
        finally:
            lab.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def real() -> Iterator[Lab]:
    yield from _lab("")


@pytest.fixture(scope="module")
def old() -> Iterator[Lab]:
    """The set-up issue 8 found: uid 0 inside is host root with CAP_SYS_ADMIN."""
    yield from _lab("host-root")


@pytest.fixture(scope="module")
def no_seccomp() -> Iterator[Lab]:
    yield from _lab("seccomp")


# -- privileges -------------------------------------------------------------------------


def test_cells_run_unprivileged_with_no_new_privs_and_seccomp(real: Lab, old: Lab) -> None:
    for node in ("root", "root.0"):
        me = real.probe("identity()", node)
        assert me["uid"] != 0 and me["cap_eff"] == 0 and me["no_new_privs"] == "1" and me["seccomp"] == "2", me
    weak = old.probe("identity()")
    assert weak["uid"] == 0 and weak["cap_eff"] != 0  # the probe sees host root when it is there


def test_the_machine_etc_is_minimal_and_var_opt_are_absent(real: Lab, old: Lab) -> None:
    me = real.probe("identity()")
    assert "shadow" not in me["etc"] and "sudoers" not in me["etc"] and "passwd" in me["etc"]
    assert me["var"] == "only /var/tmp -> /tmp" and me["opt"] is False
    assert "shadow" in old.probe("identity()")["etc"]


def test_remounting_read_write_and_writing_host_paths_fail(real: Lab, old: Lab) -> None:
    for node in ("root", "root.1"):
        got = real.probe("remount_rw_and_write(['/ro', '/usr', '/run/smolbench-agent', '/etc'])", node)
        assert not any(got.values()), got
        got = real.probe("write_plain(['/ro', '/usr', '/etc', '/', '/run', '/run/smolbench-agent'])", node)
        assert not any(got.values()), got
    assert not (real.ro / "probe-remount").exists() and not (real.ro / "probe-plain").exists()
    # The old set-up: the same remount makes the read-only volume (this test's own folder) writable.
    assert old.probe("remount_rw_and_write(['/ro'])") == {"/ro": True}
    assert (old.ro / "probe-remount").exists()


@pytest.mark.skipif(not AS_ROOT, reason="a root-only file needs a kernel running as root")
def test_root_only_files_and_etc_shadow_stay_unreadable(real: Lab, old: Lab) -> None:
    for node in ("root", "root.0"):
        assert real.probe("read('/ro/public.txt')", node) == "public"
        assert real.probe("read('/ro/secret.txt')", node) == "EACCES"
        assert real.probe("read('/etc/shadow')", node) == "ENOENT"
    assert old.probe("read('/ro/secret.txt')") == "host secret"
    assert old.probe("read('/etc/shadow')") not in ("ENOENT", "EACCES")


def test_mounting_needs_privileges_the_machine_does_not_have(real: Lab, old: Lab) -> None:
    for node in ("root", "root.0"):
        assert real.probe("direct_mounts()", node) == {"tmpfs": False, "proc": False}
    assert old.probe("direct_mounts()")["tmpfs"] is True


def test_host_processes_are_invisible_and_ptrace_is_refused(real: Lab, no_seccomp: Lab) -> None:
    pid = real.sleeper.pid
    for node in ("root", "root.1"):
        assert real.probe(f"host_pid({pid})", node) == {"signal": False, "proc": False}
        assert real.probe("ptrace_own_child()", node) is False
    assert real.sleeper.poll() is None
    # Without the seccomp filter, the same probe can attach to a process.
    assert no_seccomp.probe("ptrace_own_child()") is True


def test_host_loopback_is_unreachable_without_network(real: Lab, tmp_path: Path) -> None:
    """(With the network on too: tests/test_netpolicy.py.)"""
    for node in ("root", "root.0"):
        assert real.probe(f"reach({real.port})", node) is False
    netted = _lab("net-share", net=True)  # the old set-up: a machine with network shared the host's
    lab = next(netted)
    try:
        assert lab.probe(f"reach({lab.port})") is True  # the probe does see a reachable host server
    finally:
        netted.close()


USERNS_SCRIPT = """
for t in /ro /etc /run/smolbench-agent {extra}; do
  mount -o remount,rw,bind $t 2>/dev/null; touch $t/probe-userns 2>/dev/null && echo write:$t
done
cat /ro/secret.txt >/dev/null 2>&1 && echo read:secret
cat /etc/shadow >/dev/null 2>&1 && echo read:shadow
mount -t proc proc /proc 2>/dev/null && echo mount:proc
ls /run/smolbench | grep -qvE '^(s|k)$' && echo see:run
true
"""


def test_a_fresh_user_namespace_gives_no_way_out(real: Lab, old: Lab) -> None:
    """`unshare -r -m` (allowed: branching needs it) makes the cell root of its own view only."""
    # A kernel that is not root runs its machines as its own uid: the planted secret is then
    # that user's own file in a volume the user granted, readable by design.
    granted = set() if os.geteuid() == 0 else {"read:secret"}
    for node in ("root.0", "root.1"):
        got = real.probe(f"in_new_userns({USERNS_SCRIPT.format(extra='/usr')!r})", node)
        assert got["rc"] == 0 and set(got["out"]) <= granted, got
    assert not (real.ro / "probe-userns").exists()
    # The same script under the old set-up reads /etc/shadow: it handed out host root, which
    # only a root kernel has to give (as a user, the old set-up can't even map uid 0).
    if os.geteuid() == 0:
        got = old.probe(f"in_new_userns({USERNS_SCRIPT.format(extra='')!r})")
        assert {"read:shadow"} <= set(got["out"]), got


def test_a_branch_sees_no_sibling_through_proc(real: Lab, old: Lab) -> None:
    assert real.probe("sibling_files('sibling-root.1')", "root.0") == []
    assert old.probe("sibling_files('sibling-root.1')", "root.0") != []


def test_a_branch_cannot_reach_its_siblings_or_parents_agent(real: Lab, old: Lab) -> None:
    code = "open('/workspace/pwned', 'w').write('x')"
    assert real.probe(f"foreign_agents('root.0', {code!r})", "root.0") == []
    for node in ("root", "root.1"):
        assert real.probe("os.path.exists('/workspace/pwned')", node) is False
    ran = old.probe(f"foreign_agents('root.0', {code!r})", "root.0")
    assert {name for name, status in ran} >= {"root", "root.1"} and all(s == "ok" for _, s in ran)
    assert old.probe("os.path.exists('/workspace/pwned')", "root") is True


def test_writing_past_the_disk_limit_fails_inside_and_the_machine_carries_on(real: Lab, old: Lab) -> None:
    got = real.probe(f"fill_disk({DISK_MIB + 32})", "root.1")
    assert got["error"] == "ENOSPC" and got["written"] <= DISK_MIB, got
    assert real.probe("1 + 1", "root.1") == 2
    assert old.probe(f"fill_disk({DISK_MIB + 32})", "root.1")["error"] is None  # no limit there


def test_status_says_how_the_machine_is_contained(real: Lab) -> None:
    real.ok("%smol use root")
    status = "".join(o.get("text", "") for o in real.ok("%smol status").outputs if o.get("output_type") == "stream")
    assert "no capabilities" in status and "seccomp on" in status and "copy-on-write (overlayfs)" in status, status


def _socket_redirect(weaken: str) -> tuple[list[bytes], str]:
    """A cell swaps its agent socket for a link to a host socket; what reaches the host socket."""
    old = os.environ.get("SMOLBENCH_TEST_WEAKEN")
    os.environ["SMOLBENCH_TEST_WEAKEN"] = weaken
    try:
        with host_socket() as (path, got), NotebookSession(path.parent, allow_errors=True) as nb:
            nb.run("%load_ext smolbench")
            nb.run("%smol up --backend sandbox")
            nb.run(f"%%smol\nimport os\nos.unlink('/run/smolbench/s')\nos.symlink({str(path)!r}, '/run/smolbench/s')")
            after = error_text(nb.run("%%smol\n1 + 1"))
    finally:
        if old is None:
            os.environ.pop("SMOLBENCH_TEST_WEAKEN", None)
        else:
            os.environ["SMOLBENCH_TEST_WEAKEN"] = old
    return got, after


def test_a_machine_cannot_point_the_host_at_a_host_socket() -> None:
    got, after = _socket_redirect("")
    assert got == [] and "not answering" in after
    got, _ = _socket_redirect("host-root")  # the host followed the machine's link before
    assert got and b'"op"' in got[0]
