"""The ``smolbench`` command: ``demo``, ``doctor``, ``image build``, ``packages``, ``cluster local`` and ``serve``."""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


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


def _client(nb: Any, cwd: Path, timeout: int) -> Any:
    """A headless notebook client whose kernel talks over local IPC sockets in ``cwd``
    (no TCP ports: nothing to collide with, nothing reachable from outside)."""
    from nbclient import NotebookClient
    from traitlets.config import Config

    config = Config({"KernelManager": {"transport": "ipc", "ip": str(cwd / ".kernel")}})
    return NotebookClient(nb, timeout=timeout, kernel_name="python3", config=config,
                          resources={"metadata": {"path": str(cwd)}})


def demo(args: argparse.Namespace) -> int:
    """Run the fork-exploration notebook (or another) headless and print what happened."""
    import nbformat
    from nbclient.exceptions import CellExecutionError

    notebook = args.notebook or _default_notebook()
    if notebook is None:
        print("smolbench: the demo notebook is missing from this install: pass --notebook PATH", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="smolbench-demo-"))
    up_args = f"--backend {args.backend}" if args.backend != "auto" else ""
    print(f"smolbench demo · working in {work}")
    try:
        print(f"running {notebook} headless through a real Jupyter kernel\n")
        nb = nbformat.read(notebook, as_version=4)
        if args.backend != "auto":
            for cell in nb.cells:
                if cell.cell_type == "code" and cell.source.lstrip().startswith("%smol up"):
                    cell.source = cell.source.replace("%smol up", f"%smol up {up_args}", 1)
        client = _client(nb, work, 600)
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
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _indent(text: str) -> str:
    return "\n".join("   " + line for line in text.splitlines())


DEMO_NOTEBOOK = "02_fork_exploration.ipynb"


def _default_notebook() -> str | None:
    pkg = Path(__file__).resolve().parent
    # a wheel ships the notebooks inside the package; a source checkout has them beside it
    for candidate in (pkg / "notebooks" / DEMO_NOTEBOOK, pkg.parent / "notebooks" / DEMO_NOTEBOOK):
        if candidate.exists():
            return str(candidate)
    return None


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
        if args.allow:
            ok, detail = _net_smoke(args.allow)
            print(f"  {'OK' if ok else 'FAILED'}: {detail}")
        else:
            print("  network by name: not checked (`smolbench doctor --allow pypi.org:443` checks that a machine "
                  "reaches a host by name through the egress proxy)")
    else:
        print("  bubblewrap is not installed: `--backend sandbox` refuses to start, and `auto` falls back to")
        print("  the process backend (plain processes, NO isolation)")
        print("  → apt-get install bubblewrap")
    for line in net_tools():
        print(f"  {line}")
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
            print(f"  {mod}: not installed" + (" (pip install 'jupyterlab-smolbench[lab]')" if mod == "jupyterlab" else ""))
    return 0


def net_tools(search: str | None = None) -> list[str]:
    """The doctor's lines on ``nft`` and ``ip``, looked for as the sandbox looks (``search``:
    instead of the system folders): its network policy lets raw TCP out with them."""
    from .backends._netredirect import TOOLS, found

    lines = [f"{name}: {found(name, search) or 'missing'}" for name in TOOLS]
    missing = [pkg for name, pkg in TOOLS.items() if not found(name, search)]
    if missing:
        lines.append(f"→ apt-get install {' '.join(missing)}: without them a sandbox machine whose network lists an "
                     "address or a network (or is net = true) can't start")
    return lines


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


NET_CHECK = r"""
import socket
target = {target!r}
try:
    s = socket.create_connection(("127.0.0.1", 3128), timeout=60)
    s.settimeout(60)
    s.sendall(("CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (target, target)).encode())
    said = s.recv(600).split(b"\r\n")[0].decode("ascii", "replace")
    s.close()
except OSError as exc:
    said = "no answer from the egress proxy (%s)" % exc
said
"""


def _net_smoke(allow: str) -> tuple[bool, str]:
    """A machine allowed ``allow`` (``%smol up --allow`` words) asks the egress proxy for the
    first host listed: the real path (the lookup and connection the proxy makes, as the
    sandbox uid when this is root), not a lookup here."""
    import ast

    from . import _loop
    from .backends.base import CellRequest
    from .backends.sandbox import SandboxBackend
    from .netpolicy import NetPolicy, PolicyError, session_override
    from .spec import MachineSpec

    try:
        policy = NetPolicy.from_words(None, allow)
    except PolicyError as exc:
        return False, str(exc) if str(exc).startswith("--allow") else f"--allow: {exc}"
    if not policy.hosts:
        return False, f"--allow {allow!r} names no host to check (a host name like pypi.org:443)"
    host = policy.hosts[0]
    target = f"{host.name}:{host.port or 443}"
    spec = session_override(MachineSpec(), None, allow, "doctor")[0]

    async def go() -> str:
        b = SandboxBackend()
        try:
            ref = await b.create(spec, "doctor-net")
            res = await b.exec_cell(ref, CellRequest(NET_CHECK.format(target=target)), lambda e: None)
            text = (res.result or {}).get("text/plain", "")
            return str(ast.literal_eval(text)) if text else f"the check raised: {res.error}"
        finally:
            await b.close()

    try:
        said = _loop.run(go(), timeout=180)
    except Exception as exc:  # doctor must always finish its report
        return False, f"a machine allowed {allow} could not start: {exc}"
    if said.startswith("HTTP/1.1 200"):
        return True, f"{target} resolved and connected through the egress proxy (a machine allowed {allow})"
    return False, f"{target} through the egress proxy: {said}"


def image_build(args: argparse.Namespace) -> int:
    """Build a pinned Debian rootfs for the sandbox backend."""
    from .errors import SmolbenchError
    from .images import build_debian_rootfs

    try:
        with _stopped_by_signals():
            path = build_debian_rootfs(args.name, suite=args.suite, force=args.force)
    except SmolbenchError as exc:
        print(f"smolbench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"smolbench: the build of {args.name} was stopped: nothing was built, its build folder is removed",
              file=sys.stderr)
        return 130
    print(f"built {args.name} at {path}\nuse it from a Smolfile:  image = \"{args.name}\"")
    return 0


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """Ctrl-C, SIGTERM (a job cancelled) and SIGHUP (its terminal closed) stop the block as a
    KeyboardInterrupt, whose clean-up (debootstrap ended, its folder removed) a second signal
    can't cut short; the handlers before are put back after. Off the main thread: nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before: dict[signal.Signals, Any] = {}

    def stop(signum: int, frame: Any) -> None:
        for one in before:
            signal.signal(one, signal.SIG_IGN)
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # (nohup's SIGHUP stays ignored)
            before[sig] = signal.signal(sig, stop)
    try:
        yield
    finally:
        for was, handler in before.items():
            signal.signal(was, handler)


def image_list(args: argparse.Namespace) -> int:
    """List cached rootfs images."""
    from .images import list_images

    for name, path, size in list_images():
        print(f"{name}\t{size / 1e6:.0f} MB\t{path}")
    return 0


def packages_list(args: argparse.Namespace) -> int:
    """List the cache of Smolfile packages, least recently used first."""
    from . import packages
    from .errors import SmolbenchError
    from .gate.terminal import printable

    try:
        found = packages.entries()
    except SmolbenchError as exc:
        print(f"smolbench: {exc}", file=sys.stderr)
        return 1
    def shown(value: object) -> str:  # a planted or older packages.json, a folder's name: no escapes, one field
        return printable(str(value)).replace("\t", "\\t").replace("\n", "\\n")

    for e in found:
        used = time.strftime("%Y-%m-%d", time.localtime(e.used))
        if e.refused:
            print(f"{shown(e.path.name)}\t{e.size / 1e6:.0f} MB\tused {used}\tREFUSED: {shown(e.refused)}")
            continue
        reqs, sources = e.meta.get("requirements"), e.meta.get("sources")
        said = " ".join(map(shown, reqs)) if isinstance(reqs, list) else "?"
        where = f"\tfrom {', '.join(map(shown, sources))}" if isinstance(sources, list) and sources else ""
        print(f"{shown(e.path.name)}\t{e.size / 1e6:.0f} MB\tused {used}\t{shown(e.meta.get('python', '?'))}\t"
              f"{said}{where}")
    print(f"{len(found)} entr{'y' if len(found) == 1 else 'ies'}, {sum(e.size for e in found) / 1e6:.0f} MB in "
          f"{shown(packages.packages_root())}")
    return 0


def packages_prune(args: argparse.Namespace) -> int:
    """Remove cached Smolfile packages no up used in --days days."""
    from . import packages
    from .errors import SmolbenchError

    try:
        removed, in_use = packages.prune(args.days, dry_run=args.dry_run)
    except SmolbenchError as exc:
        print(f"smolbench: {exc}", file=sys.stderr)
        return 1
    for path in in_use:
        print(f"kept {path}: a running machine uses it (`%smol down` it, then prune again)")
    for path, size in removed:
        print(f"{'would remove' if args.dry_run else 'removed'} {path} ({size / 1e6:.0f} MB)")
    print(f"{len(removed)} folder{'s' if len(removed) != 1 else ''}, {sum(s for _, s in removed) / 1e6:.0f} MB"
          f"{' would be' if args.dry_run else ''} freed in {packages.packages_root()}")
    return 0


def cluster_local(args: argparse.Namespace) -> int:
    """A throwaway multi-node Ray cluster on this machine, until Ctrl-C (or SIGTERM)."""
    import signal
    import threading

    from .cluster.local import LocalCluster
    from .errors import SmolbenchError

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    try:
        cluster = LocalCluster(args.nodes, slots=args.slots, backends=args.backend.split(","))
    except SmolbenchError as exc:
        print(f"smolbench: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"smolbench: a local Ray cluster with {args.nodes} node(s), {args.slots} machine slots each, "
              "on 127.0.0.1 and only for who holds its token\n"
              f"RAY_ADDRESS={cluster.address}\nRAY_AUTH_MODE=token\nRAY_AUTH_TOKEN_PATH={cluster.token_path}\n"
              f"in a notebook on this machine:  %env RAY_AUTH_MODE=token  then  %env RAY_AUTH_TOKEN_PATH="
              f"{cluster.token_path}  then  %smol up --ray {cluster.address}\n"
              "Ctrl-C stops it and removes everything it made", flush=True)
        stop.wait()
    finally:
        cluster.stop()
        print("smolbench: the local Ray cluster is stopped", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``smolbench`` command's parser, with every subcommand."""
    ap = argparse.ArgumentParser(prog="smolbench", description="A Jupyter workbench for RL environments in forkable machines.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run the fork-exploration notebook (02) headless through a real kernel and print what happened")
    d.add_argument("--backend", default="auto", choices=["auto", "smol", "sandbox", "process"],
                   help="where its machines run (default auto: a microVM where one boots, else a sandbox)")
    d.add_argument("--notebook", default=None, help="run this notebook instead of the built-in one")
    d.set_defaults(fn=demo)
    doc = sub.add_parser("doctor", help="which backends are usable here and why not")
    doc.add_argument("--fresh", action="store_true", help="re-run the microVM boot probe instead of using its cached verdict")
    doc.add_argument("--allow", default="",
                     help="hosts (and CIDRs) a machine is allowed, as for `%%smol up --allow`: the first host must "
                          "resolve and connect through the sandbox's egress proxy, e.g. pypi.org:443")
    doc.set_defaults(fn=doctor)
    img = sub.add_parser("image", help="pinned rootfs images for the sandbox backend")
    isub = img.add_subparsers(dest="action", required=True)
    b = isub.add_parser("build", help="build a Debian rootfs with python3 (debootstrap, ~40 s)")
    b.add_argument("name", nargs="?", default="debian:bookworm",
                   help="the image's name, as a Smolfile's image = names it (default: debian:bookworm)")
    b.add_argument("--suite", default=None, help="the Debian suite to build from (default: the one a debian:SUITE name says, else bookworm)")
    b.add_argument("--force", action="store_true", help="build it again even if it is cached")
    b.set_defaults(fn=image_build)
    ls = isub.add_parser("list", help="list cached images")
    ls.set_defaults(fn=image_list)
    pk = sub.add_parser("packages", help="the cache of Smolfile packages pip installed on this host")
    psub = pk.add_subparsers(dest="action", required=True)
    psub.add_parser("list", help="list cached package installs, least recently used first").set_defaults(fn=packages_list)
    pr = psub.add_parser("prune", help="remove cached package installs no up used lately (reinstalled when next needed)")
    pr.add_argument("--days", type=float, default=30.0,
                    help="remove those unused for this many days (default 30; 0: all, even one a running machine uses)")
    pr.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    pr.set_defaults(fn=packages_prune)
    cl = sub.add_parser("cluster", help="Ray clusters for %%smol up --ray")
    csub = cl.add_subparsers(dest="action", required=True)
    loc = csub.add_parser("local", help="a throwaway multi-node Ray cluster on this machine (until Ctrl-C)")
    loc.add_argument("--nodes", type=int, default=3, help="worker nodes (default 3; the head runs no machines)")
    loc.add_argument("--slots", type=int, default=8, help="machine slots per node (default 8)")
    loc.add_argument("--backend", default="auto", help="node backends, cycled over the nodes: auto, sandbox, process, smol")
    loc.set_defaults(fn=cluster_local)
    from .serve import add_parser as add_serve

    add_serve(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``smolbench`` command."""
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

