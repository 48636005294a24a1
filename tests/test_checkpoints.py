"""Checkpoints end to end in a real kernel (nbclient): save, down, up, restore; the widget
state the notebook keeps; and one clear line for each kind of bad input."""

from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path
from typing import Any

from ckpthelpers import held_hand_over, interrupt_once_started
from nbhelpers import NotebookSession, error_output, plain_texts, stream_text

from smolbench.ledger import Ledger

WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def one_line_error(cell: Any, ename: str = "SmolbenchError") -> str:
    """The cell's error, which must be a single line with no traceback of our layers."""
    err = error_output(cell)
    assert err is not None, f"expected an error, got {cell.outputs}"
    assert err.ename == ename, err
    assert len(err.traceback) == 1, err.traceback
    text = re.sub(r"\x1b\[[0-9;]*m", "", err.traceback[0])
    assert "\n" not in text
    return text


def models(nb: Any, anywidget_id: str) -> list[dict[str, Any]]:
    state = nb.metadata["widgets"][WIDGET_STATE]["state"]
    return [m["state"] for m in state.values() if m["state"].get("_anywidget_id") == anywidget_id]


def test_fork_then_checkpoint_round_trip_through_down_and_up(tmp_path: Path) -> None:
    with NotebookSession(tmp_path) as s:
        s.run("%load_ext smolbench")
        s.run("%smol up --backend sandbox")
        s.run(
            "%%smol\nimport threading\nx = 41\nlock = threading.Lock()\n"
            "open('notes.txt', 'w').write('warm state')\ndef f(v):\n    return v + x"
        )
        # a module outside the workspace (here /tmp) is not part of a sandbox checkpoint
        s.run(
            "%%smol\nimport sys\nopen('/tmp/extmod.py', 'w').write('class Thing: pass')\n"
            "sys.path.insert(0, '/tmp')\nimport extmod\nthing = extmod.Thing()"
        )
        s.run("%%smol fork 8 --seed-base 100\nreward = SEED * 2 + x")
        save = s.run("%smol checkpoint save warm")
        listed = s.run("%smol checkpoint list")
        s.run("%smol down")
        s.run("%smol up --backend sandbox")
        restore = s.run("%smol checkpoint restore warm")
        check = s.run("%%smol\nprint(x, f(1), open('notes.txt').read(), 'lock' in dir())")
        tree = s.run("%smol tree")
        s.run("%smol down")
        s.client.set_widgets_metadata()
    nb = s.nb

    assert "saved checkpoint warm of root" in stream_text(save)
    assert "lock (TypeError)" in stream_text(save, "stderr")  # unpicklable: named in a warning
    shown = [o for o in listed.outputs if o.output_type == "display_data"]
    # the panel stays live through down / up (its saved copy shows the last state: all down)
    assert "application/vnd.jupyter.widget-view+json" in shown[0]["data"]  # the panel
    assert shown[1]["data"]["text/plain"] == "smolbench checkpoints (none up): warm"  # its static copy
    assert 'data-name="warm"' in shown[1]["data"]["text/html"]
    assert "restored warm as r1-warm (now active)" in stream_text(restore)
    warning = stream_text(restore, "stderr")
    assert "warning: not restored: " in warning and "thing (ModuleNotFoundError" in warning
    # variables, functions and files came back; the unpicklable lock did not
    assert stream_text(check) == "41 42 warm state False\n"
    assert "r1-warm" in plain_texts(tree)[-1]

    # the notebook keeps each tree model's last state (nbclient store_widget_state)
    trees = models(nb, "smolbench.widgets.tree.TreeWidget")
    assert len(trees) == 2, trees
    first = next(t for t in trees if any(n["id"] == "root.7" for n in t["nodes"]))
    nodes = {n["id"]: n for n in first["nodes"]}
    assert set(nodes) == {"root"} | {f"root.{i}" for i in range(8)}
    assert (
        nodes["root.7"]["reward"] == 255
        and nodes["root.7"]["seed"] == 107
        and nodes["root.7"]["status"] == "ok"
    )
    assert nodes["root"]["checkpoint"] == "warm"
    assert first["best_path"] == ["root", "root.7"] and first["busy"] == ""
    assert not any(n["alive"] for n in first["nodes"]), first["nodes"]  # after `%smol down`
    assert "https://" not in first["_esm"] and "export default" in first["_esm"]  # shipped, no CDN
    second = next(t for t in trees if t is not first)
    assert [n["id"] for n in second["nodes"]] == ["root", "r1-warm"]
    [panel] = models(nb, "smolbench.widgets.checkpoints.CheckpointPanel")
    assert [c["name"] for c in panel["checkpoints"]] == ["warm"]


def test_bad_checkpoint_input_gets_one_clear_line_each(tmp_path: Path) -> None:
    ckdir = tmp_path / ".smolbench" / "checkpoints"
    with NotebookSession(tmp_path, allow_errors=True) as s:
        s.run("%load_ext smolbench")
        s.run("%smol up --backend sandbox")
        s.run("%%smol\nx = 1")

        missing = one_line_error(s.run("%smol checkpoint restore nope"))
        assert "no checkpoint named 'nope'" in missing and "%smol checkpoint list" in missing

        s.run("%smol checkpoint save good")
        exists = one_line_error(s.run("%smol checkpoint save good"))
        assert "a checkpoint named 'good' exists" in exists and "--force" in exists
        assert error_output(s.run("%smol checkpoint save good --force")) is None

        # a checkpoint made by a microVM kernel that shares this ledger
        Ledger(tmp_path / ".smolbench" / "ledger.db").add_checkpoint(
            "vm", "another-session", "root", str(ckdir / "good.smolcheckpoint"), "smol", 1234, 1, []
        )
        other = one_line_error(s.run("%smol checkpoint restore vm"))
        assert "made by the smol backend" in other and "%smol up --backend smol" in other

        # a failed save (the checkpoint file can't be written) leaves nothing listed
        (ckdir / "bad.smolcheckpoint").mkdir()  # a folder where the file would go
        failed = one_line_error(s.run("%smol checkpoint save bad"))
        assert "saving checkpoint 'bad' of root failed" in failed and "nothing was saved" in failed
        assert not (ckdir / "bad.smolcheckpoint").is_file() and not list(ckdir.glob(".bad*"))
        listed = s.run(
            "import smolbench\n"
            "print(sorted(smolbench._magics.workbench.ledger.checkpoints()['name']))"
        )
        assert stream_text(listed) == "['good', 'vm']\n"

        good = ckdir / "good.smolcheckpoint"
        data = good.read_bytes()
        # a corrupt namespace inside an intact archive
        with tarfile.open(good, "r:gz") as tar:
            member = tar.extractfile("workspace.tar")
            assert member is not None
            workspace = member.read()
        with tarfile.open(good, "w:gz") as tar:
            for name, blob in (("namespace.pkl", b"not a pickle"), ("workspace.tar", workspace)):
                info = tarfile.TarInfo(name)
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
        replaced = one_line_error(s.run("%smol checkpoint restore good"))  # not the file its signed row names
        assert "is not the file saved as it" in replaced and "`%smol checkpoint rm good` forgets it" in replaced
        s.run("%smol checkpoint trust good")  # checked as a file from elsewhere (its pickle is not read), signed
        corrupt = one_line_error(s.run("%smol checkpoint restore good"))
        assert "is corrupt" in corrupt and "can't be loaded" in corrupt

        good.write_bytes(data[: len(data) // 2])  # truncated
        assert "is not the file saved as it" in one_line_error(s.run("%smol checkpoint restore good"))
        truncated = one_line_error(s.run("%smol checkpoint trust good"), "UnusableCheckpoint")
        assert "good.smolcheckpoint is cut short" in truncated and "it was not signed" in truncated, truncated

        good.unlink()
        gone = one_line_error(s.run("%smol checkpoint restore good"))
        assert "missing its file" in gone and "%smol checkpoint rm good" in gone

        tree = s.run("%smol tree")
        assert plain_texts(tree)[-1].splitlines()[1].startswith("root")
        assert "r1-" not in plain_texts(tree)[-1]  # failed restores leave no machine behind
        s.run("%smol down")


def test_ctrl_c_during_a_checkpoint_save_saves_nothing_and_keeps_the_machine(tmp_path: Path) -> None:
    """A Ctrl-C reached the notebook while the save went on on smolbench's loop: the checkpoint
    appeared later, saved from a machine the next cells were already changing."""
    import threading
    import time

    folder = tmp_path / ".smolbench" / "checkpoints"
    with NotebookSession(tmp_path, allow_errors=True) as nb:
        nb.run("%load_ext smolbench")
        nb.run("%smol up --backend sandbox")
        nb.run("%%smol\nimport os\nopen('big.bin', 'wb').write(os.urandom(150 * 2**20))\nkept = 'warm'")

        def interrupt_while_it_writes() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not list(folder.glob(".big.smolcheckpoint.*.part")):
                time.sleep(0.01)
            nb.interrupt()  # while it packs the machine's files

        t = threading.Thread(target=interrupt_while_it_writes)
        t.start()
        cell = nb.run("%smol checkpoint save big")
        t.join()
        err = error_output(cell)
        assert err is not None and err.ename == "KeyboardInterrupt", cell.outputs
        # stopped before the Ctrl-C came back: nothing of it is written, or still being written
        assert sorted(p.name for p in folder.iterdir()) == [], f"the save went on after the Ctrl-C: {sorted(p.name for p in folder.iterdir())}"
        listed = nb.run("%smol checkpoint list")
        assert "big" not in str(listed.outputs)
        after = nb.run("%%smol\nkept")
        assert "'warm'" in str(after.outputs)
        again = nb.run("%smol checkpoint save big")
        assert "saved checkpoint big of root" in stream_text(again)

        # and a restore stopped halfway makes no machine, and leaves root the active one: stopped
        # while it hands the checkpoint over into its new machine (held there until the Ctrl-C is sent)
        copying, go, handed = tmp_path / "copying", tmp_path / "go", tmp_path / "handed"
        nb.run(held_hand_over(copying, go, handed))

        t = interrupt_once_started(nb, copying, go)
        t.start()
        restore = nb.run("%smol checkpoint restore big")
        assert handed.exists(), "the Ctrl-C came back while the restore went on"
        t.join()
        err = error_output(restore)
        assert err is not None and err.ename == "KeyboardInterrupt", restore.outputs
        machines = nb.run("import smolbench\nsorted(smolbench.session().workbench.machines)")
        assert "['root']" in str(machines.outputs)
        assert "'warm'" in str(nb.run("%%smol\nkept").outputs)
        nb.run("%smol down")
    assert Ledger(tmp_path / ".smolbench" / "ledger.db").checkpoint("big") is not None
    # the stopped save's thread wrote into the part file it had removed, not into a new one
    assert sorted(p.name for p in folder.iterdir()) == ["big.smolcheckpoint"]


def test_a_restore_stopped_while_it_copies_the_checkpoint_in_ends_that_copy_first(tmp_path: Path) -> None:
    """A restore stopped while the checkpoint's files were copied into the new machine's folder
    deleted that machine and its folder at once, while the copy went on in its thread (up to the
    checkpoint limit, into files already removed, or into a folder the removal had listed)."""
    import asyncio
    import contextlib
    import threading
    import time

    from smolbench.backends.process import ProcessBackend
    from smolbench.spec import MachineSpec

    runs = tmp_path / "runs"
    runs.mkdir()
    backend = ProcessBackend(runtime_dir=str(runs))
    copying, go, ended = threading.Event(), threading.Event(), threading.Event()
    hand_over = backend._hand_over

    def slow_hand_over(path: str, folder: Any) -> str:
        copying.set()
        try:
            go.wait(60)  # held until the stopped restore came back, or had 5 s to
            return hand_over(path, folder)
        finally:
            ended.set()

    backend._hand_over = slow_hand_over  # type: ignore[method-assign]
    seen: list[tuple[bool, list[str]]] = []

    async def main() -> None:
        try:
            root = await backend.create(MachineSpec(), "root")
            path = str(tmp_path / "c.smolcheckpoint")
            await backend.checkpoint(root, path)
            restore = asyncio.ensure_future(backend.restore(path, "r1", MachineSpec()))
            while not copying.is_set():
                await asyncio.sleep(0.01)
            restore.cancel()
            deadline = time.monotonic() + 5  # one that does not wait for its copy comes back well within this
            while not restore.done() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            early = restore.done()  # while its copy is held: it did not wait for it
            go.set()
            with contextlib.suppress(asyncio.CancelledError):
                await restore
            seen.append((ended.is_set() and not early, sorted(m.name for m in backend.list())))
        finally:
            await backend.close()

    asyncio.run(main())
    assert seen == [(True, ["root"])], f"the stopped restore came back while its copy went on: {seen}"
    assert [p.name for p in runs.iterdir()] == []
