"""A branch's save is packed from its stage, below its run folder, below its parent's: folders
the root machine can swap. The stage was opened by its path with O_NOFOLLOW on the last part
only, so a root that swapped a parent folder for a link (an absolute one: below /proc/PID/root
it resolves from the host's root) while the branch saved made the host pack files from
wherever the link pointed. Now the stage is opened through the walk every other host access
below a run folder takes (``_below``): no link of the machine's is followed. (Since its two
files come through fifos opened then, before the save, nothing is read from the stage after.)"""

from __future__ import annotations

import asyncio
import tarfile
from pathlib import Path

import pytest
from gymhelpers import needs_bwrap

from smolbench.backends.base import CellRequest
from smolbench.backends.sandbox import SandboxBackend
from smolbench.spec import MachineSpec

EMPTY_TAR = "import io, tarfile\nempty = io.BytesIO()\ntarfile.open(fileobj=empty, mode='w').close()\n"

# The branch's agent, rewritten: its save writes a stage of its own, then waits for the root's word.
SAVE_AND_WAIT = EMPTY_TAR + '''
import os, sys, time
frame = sys._getframe()  # the agent runs this cell: it is up the stack (a branch's gc froze it out of sight)
while type(frame.f_locals.get("self")).__name__ != "Agent":
    frame = frame.f_back
agent = frame.f_locals["self"]
def save(path):
    os.makedirs(path, exist_ok=True)  # the host made it, with the fifo its workspace archive goes into
    open(path + "/namespace.pkl", "wb").write(b"the branch's own save")
    open(path + "/workspace.tar", "wb").write(empty.getvalue())
    open(path + "/ready", "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(path + "/go") and time.monotonic() < deadline:
        time.sleep(0.005)
    return {"t": "done", "status": "ok", "skipped": [], "saved": []}
agent.save = save
'''

# The root: once the branch's stage is written, the same stage name elsewhere (its own /tmp,
# reached by the host as /proc/HOSTPID/root/tmp), and the branch's parent folder a link to it.
SWAP = EMPTY_TAR + '''
import os, threading, time
def swap():
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        staged = [n for n in os.listdir("/run/smolbench/1/0") if os.path.exists(f"/run/smolbench/1/0/{n}/ready")]
        if staged:
            break
        time.sleep(0.005)
    stage = staged[0]
    os.makedirs(f"/tmp/elsewhere/0/{stage}")
    open(f"/tmp/elsewhere/0/{stage}/namespace.pkl", "wb").write(b"outside the run folder")
    open(f"/tmp/elsewhere/0/{stage}/workspace.tar", "wb").write(empty.getvalue())
    os.rename("/run/smolbench/1", "/run/smolbench/was1")
    os.symlink("/proc/HOSTPID/root/tmp/elsewhere", "/run/smolbench/1")
    open(f"/run/smolbench/was1/0/{stage}/go", "w").close()
threading.Thread(target=swap, daemon=True).start()
'''


@needs_bwrap
def test_a_root_that_links_a_saving_branch_s_parent_folder_elsewhere_is_not_followed(tmp_path: Path) -> None:
    async def main() -> None:
        (tmp_path / "run").mkdir()
        be = SandboxBackend(runtime_dir=str(tmp_path / "run"))
        root = await be.create(MachineSpec(), "root")
        try:
            [mid] = await be.branch(root, ["root.1"], [None])
            assert (await be.exec_cell(mid, CellRequest("1 + 1"), lambda ev: None)).status == "ok"
            [leaf] = await be.branch(mid, ["root.1.0"], [None])
            assert leaf.info["host_dir"].endswith("/run/smolbench/1/0"), leaf.info["host_dir"]
            for ref, code in ((leaf, SAVE_AND_WAIT), (root, SWAP.replace("HOSTPID", str(root.info["host_pid"])))):
                res = await be.exec_cell(ref, CellRequest(code), lambda ev: None)
                assert res.status == "ok", res.error
            out = tmp_path / "c.smolcheckpoint"
            # before: packed from /tmp/elsewhere, the checkpoint held b"outside the run folder"
            await asyncio.wait_for(be.checkpoint(leaf, str(out)), 120)
            with tarfile.open(out) as tar:
                held = tar.extractfile("namespace.pkl")
                assert held is not None and held.read() == b"the branch's own save"
            res = await be.exec_cell(root, CellRequest("1 + 1"), lambda ev: None)  # the root goes on
            assert res.status == "ok", res.error
        finally:
            await be.close()

    asyncio.run(main())


def test_a_restore_into_a_machine_whose_run_folder_is_a_link_writes_nothing_there(
        open_tmp: Path, tmp_path: Path) -> None:
    """A restore streamed the checkpoint into the new machine's run folder opened by its path
    (``/proc/PID/root/run/smolbench``, O_NOFOLLOW on the last part only): a machine that
    execs its agent into a root of its own whose ``/run`` is an absolute link to a host folder
    had the host write the checkpoint's files there (the stand-in machine here: unshare(1)
    and chroot(8))."""
    import os
    import shutil
    import subprocess
    import time

    from ckpthelpers import forged, record

    from smolbench.backends import _procs
    from smolbench.backends.base import MachineRef
    from smolbench.gate.archive import UnsafeCheckpoint

    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    if shutil.which("chroot") is None or not Path("/usr/bin/sleep").exists():
        pytest.skip("chroot (coreutils) or /usr/bin/sleep is not here")
    victim, top = open_tmp / "victim", open_tmp / "machine"
    (victim / "smolbench").mkdir(parents=True)
    (victim / "smolbench").chmod(0o777)  # even a folder the machine's uid may write in
    top.mkdir()
    ckpt = tmp_path / "c.smolcheckpoint"
    forged(ckpt, record())
    links = " && ".join(f"ln -s usr/{d} {top}/{d}" for d in ("bin", "lib", "lib64") if os.path.isdir(f"/usr/{d}"))
    proc = subprocess.Popen(["unshare", "-Urm", "sh", "-c",
                             f"mount -t tmpfs tmpfs {top} && mkdir {top}/usr && mount --rbind /usr {top}/usr && "
                             f"{links} && ln -s {victim} {top}/run && exec chroot {top} /usr/bin/sleep 120"])
    be = SandboxBackend(runtime_dir=str(tmp_path))
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if os.readlink(f"/proc/{proc.pid}/root/run") == str(victim):
                    break
            except OSError:
                pass
            if proc.poll() is not None:
                pytest.skip("this host can't make a user and mount namespace here (unshare -Urm failed)")
            assert time.monotonic() < deadline, "the stand-in machine never made its link"
            time.sleep(0.02)
        root = MachineRef("root", "sandbox", MachineSpec(), info={
            "root": "root", "contained": True, "host_pid": proc.pid, "host_started": _procs.start_time(proc.pid),
            "host_dir": f"/proc/{proc.pid}/root/run/smolbench"})
        be._machines["root"] = root
        with pytest.raises(UnsafeCheckpoint, match="can't be reached without following a link"):
            be._hand_over(str(ckpt), root)
        assert list((victim / "smolbench").iterdir()) == []
    finally:
        be._machines.pop("root", None)  # not one it started: nothing of it to end
        proc.kill()
        proc.wait()
        asyncio.run(be.close())
