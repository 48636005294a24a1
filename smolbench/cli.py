"""The ``smolbench`` command: ``demo``, ``doctor`` and ``image build``."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TOUR = [
    ("Load the extension", "%load_ext smolbench"),
    ("Start a warm machine (best backend available)", "%smol up {up_args}"),
    ("Run a cell inside the machine; state persists", "%%smol\nimport platform, os\nx = 41\nprint('hello from', platform.node(), 'in', os.getcwd())\nx + 1"),
    ("Send a notebook value in, bring one back", "data = [1, 2, 3]\ndef scale(v):\n    return v * 10"),
    ("", "%%smol --push data,scale --pull y\ny = scale(sum(data)) + x"),
    ("", "print('y pulled back into the notebook:', y)"),
    ("A warm, deliberately slow setup (runs once, in the parent)",
     "%%smol\nimport random, time\nt0 = time.time()\ntable = [[(i * j) % 7 for j in range(300)] for i in range(300)]\n"
     "def rollout(seed, steps=200):\n    rng = random.Random(seed)\n    pos, total = 0, 0.0\n    for _ in range(steps):\n"
     "        pos = (pos + rng.choice((-1, 1))) % 300\n        total += table[pos][seed % 300] / 6\n    return total\n"
     "print(f'setup took {time.time() - t0:.2f} s')"),
    ("Fork 16 live branches of the warm machine, one seed each",
     "%%smol fork 16 --seed-base 100 --out res --quiet\nreward = rollout(SEED)"),
    ("", "print(res.summary())"),
    ("Promote the best branch and fork again from it", "%smol use best"),
    ("", "%%smol fork 4 --quiet --out res2\nreward = rollout(SEED + 1000) + 0.001 * SEED"),
    ("The tree", "%smol tree"),
    ("What is running where", "%smol status"),
    ("Delete every machine", "%smol down"),
]


def _outputs_text(cell: Any) -> str:
    parts = []
    for out in cell.get("outputs", []):
        kind = out.get("output_type")
        if kind == "stream":
            parts.append(out.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            data = out.get("data", {})
            if "text/plain" in data and "application/vnd.jupyter.widget-view+json" not in data:
                parts.append(str(data["text/plain"]) + "\n")
        elif kind == "error":
            parts.append(f"{out.get('ename')}: {out.get('evalue')}\n")
    return "".join(parts)


def run_cells(cells: list[str], cwd: Path, timeout: int = 300) -> Any:
    """Execute cells in a real, headless ipykernel; return the executed notebook."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def demo(args: argparse.Namespace) -> int:
    """Run the guided tour (or a notebook) headless and print what happened."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    notebook = args.notebook or _default_notebook()
    work = Path(tempfile.mkdtemp(prefix="smolbench-demo-"))
    up_args = f"--backend {args.backend}" if args.backend != "auto" else ""
    print(f"smolbench demo · working in {work}")
    try:
        if notebook is not None:
            print(f"running {notebook} headless through a real Jupyter kernel\n")
            nb = nbformat.read(notebook, as_version=4)
            if args.backend != "auto":
                for cell in nb.cells:
                    if cell.cell_type == "code" and cell.source.lstrip().startswith("%smol up"):
                        cell.source = cell.source.replace("%smol up", f"%smol up {up_args}", 1)
            client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(work)}})
            try:
                client.execute()
            except CellExecutionError as exc:
                print(str(exc).splitlines()[-1] if str(exc) else "a cell failed", file=sys.stderr)
                return 1
            for cell in nb.cells:
                if cell.cell_type != "code":
                    continue
                text = _outputs_text(cell).rstrip()
                first = cell.source.strip().splitlines()[0] if cell.source.strip() else ""
                if first.startswith(("%smol", "%%smol", "print(")) and text:
                    print(f"» {first}\n{_indent(text)}\n")
            return 0
        cells = [src.replace("{up_args}", up_args) for _, src in TOUR]
        t0 = time.perf_counter()
        nb = run_cells(cells, work)
        for (title, _), cell in zip(TOUR, nb.cells):
            if title:
                print(f"\n# {title}")
            print(f"» {cell.source.splitlines()[0]}")
            text = _outputs_text(cell).rstrip()
            if text:
                print(_indent(text))
        print(f"\ntour finished in {time.perf_counter() - t0:.1f} s; every machine was deleted.")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _indent(text: str) -> str:
    return "\n".join("   " + line for line in text.splitlines())


def _default_notebook() -> str | None:
    here = Path(__file__).resolve().parent.parent / "notebooks" / "02_fork_exploration.ipynb"
    return str(here) if here.exists() else None


def doctor(args: argparse.Namespace) -> int:
    """Say which backends are usable here and why not, in plain words."""
    from .backends.sandbox import bwrap_path
    from .images import cache_dir, list_images

    print("smolbench doctor\n")
    print("microVMs (smol backend)")
    try:
        from .backends.probe import kvm_diagnosis, probe_smol

        for line in kvm_diagnosis():
            print(f"  · {line}")
        ok, reason = probe_smol(use_cache=not args.fresh)
        print(f"  {'OK' if ok else 'NOT USABLE'}: {reason}")
        if not ok:
            print("  → use the sandbox backend (`%smol up --backend sandbox`) or smol cloud (`--target cloud`, needs SMOL_CLOUD_TOKEN)")
    except Exception as exc:  # doctor must always finish its report
        print(f"  could not check: {exc}")
    print("\nsandbox backend")
    bw = bwrap_path()
    if bw:
        print(f"  OK: bubblewrap at {bw}: machines are namespace-isolated sandboxes (not VMs)")
        ok, detail = _sandbox_smoke()
        print(f"  {'OK' if ok else 'FAILED'}: {detail}")
    else:
        print("  bubblewrap is not installed: machines would run as plain processes with NO isolation")
        print("  → apt-get install bubblewrap")
    print(f"  debootstrap: {'installed' if shutil.which('debootstrap') else 'missing (apt-get install debootstrap) — needed only for `smolbench image build`'}")
    images = list_images()
    print(f"  rootfs cache: {cache_dir() / 'images'}")
    if images:
        for name, path, size in images:
            print(f"    {name}: {path} ({size / 1e6:.0f} MB)")
    else:
        print("    no pinned images yet (the default image is the host's system, read-only); `smolbench image build` makes a Debian one")
    print("\nJupyter")
    for mod in ("IPython", "ipykernel", "ipywidgets", "anywidget", "plotly", "pandas", "jupyterlab"):
        try:
            m = __import__(mod)
            print(f"  {mod} {getattr(m, '__version__', '?')}")
        except ImportError:
            print(f"  {mod}: not installed" + (" (pip install 'smolbench[lab]')" if mod == "jupyterlab" else ""))
    return 0


def _sandbox_smoke() -> tuple[bool, str]:
    from . import _loop
    from .backends.base import CellRequest
    from .backends.sandbox import SandboxBackend
    from .spec import MachineSpec

    async def go() -> str:
        b = SandboxBackend()
        t0 = time.perf_counter()
        try:
            ref = await b.create(MachineSpec(), "doctor")
            res = await b.exec_cell(ref, CellRequest("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=1); net = 'reachable'\nexcept OSError: net = 'unreachable'\nnet"), lambda e: None)
            net = (res.result or {}).get("text/plain", "?")
            return f"a sandbox started and ran a cell in {time.perf_counter() - t0:.2f} s; network inside: {net}"
        finally:
            await b.close()

    try:
        return True, _loop.run(go(), timeout=60)
    except Exception as exc:
        return False, f"a sandbox could not start: {exc}"


def image_build(args: argparse.Namespace) -> int:
    """Build a pinned Debian rootfs for the sandbox backend."""
    from .errors import SmolbenchError
    from .images import build_debian_rootfs

    try:
        path = build_debian_rootfs(args.name, suite=args.suite, force=args.force)
    except SmolbenchError as exc:
        print(f"smolbench: {exc}", file=sys.stderr)
        return 1
    print(f"built {args.name} at {path}\nuse it from a Smolfile:  image = \"{args.name}\"")
    return 0


def image_list(args: argparse.Namespace) -> int:
    """List cached rootfs images."""
    from .images import list_images

    for name, path, size in list_images():
        print(f"{name}\t{size / 1e6:.0f} MB\t{path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``smolbench`` command."""
    ap = argparse.ArgumentParser(prog="smolbench", description="A Jupyter workbench for RL environments in forkable machines.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run the guided tour headless through a real kernel and print what happened")
    d.add_argument("--backend", default="auto", choices=["auto", "smol", "sandbox", "process"])
    d.add_argument("--notebook", default=None, help="run this notebook instead of the built-in one")
    d.set_defaults(fn=demo)
    doc = sub.add_parser("doctor", help="which backends are usable here and why not")
    doc.add_argument("--fresh", action="store_true", help="re-run the microVM boot probe instead of using its cached verdict")
    doc.set_defaults(fn=doctor)
    img = sub.add_parser("image", help="pinned rootfs images for the sandbox backend")
    isub = img.add_subparsers(dest="action", required=True)
    b = isub.add_parser("build", help="build a Debian rootfs with python3 (debootstrap, ~40 s)")
    b.add_argument("name", nargs="?", default="debian:bookworm")
    b.add_argument("--suite", default="bookworm")
    b.add_argument("--force", action="store_true")
    b.set_defaults(fn=image_build)
    ls = isub.add_parser("list", help="list cached images")
    ls.set_defaults(fn=image_list)
    args = ap.parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

