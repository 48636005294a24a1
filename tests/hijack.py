"""A cell that takes over the guest agent serving it (tests of what a machine sends)."""

from __future__ import annotations

import time

from nbhelpers import NotebookSession, error_output, result_text

# Runs inside the machine: a handle on the agent that serves it, and its module globals.
HIJACK = (
    "%%smol\nimport sys, json, base64, pickle, socket\n"
    "_ag = sys.modules['smolbench_guest']._agent\n"
    # the pull encoding's module (imported when first used, so imported here first)
    "_G = vars(__import__('importlib').import_module('_smolbench_guest.pulldata'))\n"
)


def up(nb: NotebookSession) -> None:
    nb.run("%load_ext smolbench")
    nb.run("%smol up --backend sandbox")
    nb.run(HIJACK)


def one_line_error(cell: object) -> str:
    """The cell's error message, which must be one line with no traceback of our layers."""
    err = error_output(cell)  # type: ignore[arg-type]
    assert err is not None, f"no error in {cell}"
    assert "\n" not in err.evalue and len(err.traceback) <= 2, err.traceback
    return str(err.evalue)


def still_works(nb: NotebookSession) -> None:
    """The machine answers its next cell, once the hijacked cell's own end has reached its agent
    (till then it says it is busy: a loaded host takes a while)."""
    deadline = time.monotonic() + 30
    while True:
        cell = nb.run("%%smol\n6 * 7")
        err = error_output(cell)
        if err is None or err.ename != "MachineBusy" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert result_text(cell) == "42", cell.outputs
