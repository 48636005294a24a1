"""The guest agent's entry point: runs inside a machine and executes notebook cells.

Stdlib only and Python 3.8+, because it runs on the machine's own python3.
Started once per machine; it keeps one persistent namespace (the machine's
``__main__``) and serves requests on a Unix socket, one JSON line per request
(see ``protocol.py``, ``serving.py``).

A live branch is an ``os.fork()`` of this process: the child inherits the warm
namespace, gets its own socket, its own copy of the workspace and /tmp (a
private mount namespace where the kernel allows it) and its seed (``branching.py``).

The agent's other modules beside this file are imported as the package ``_smolbench_guest``,
so a user's own module named like one of them (``protocol``, ``cells``) still imports.

Usage: python3 agent.py --socket PATH --name NAME [--workdir DIR] [--lib DIR]
"""

import argparse
import importlib
import importlib.machinery
import importlib.util
import os
import signal
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = "_smolbench_guest"


def _package():
    """This folder as the package ``_smolbench_guest`` (made once per process)."""
    pkg = sys.modules.get(PACKAGE)
    if pkg is None:
        spec = importlib.machinery.ModuleSpec(PACKAGE, None, is_package=True)
        spec.submodule_search_locations = [_HERE]
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = pkg
    return pkg


def _module(name):
    _package()
    return importlib.import_module(PACKAGE + "." + name)


# -- limits the host asked for (rlimits; cgroups are the host's business) ----------


def _apply_rlimits(rlimits):
    """Lower this process's rlimits, for good (inherited by everything it starts)."""
    import resource

    for item in rlimits:
        name, _, value = item.partition("=")
        limit = int(value)
        resource.setrlimit(getattr(resource, "RLIMIT_" + name), (limit, limit))


def main(argv=None):
    """Start the agent and serve until killed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--name", default="root")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--lib", default=None, help="extra import path appended to sys.path (cloudpickle)")
    ap.add_argument("--packages", default=None, help="the Smolfile's packages (a read-only folder) for sys.path")
    ap.add_argument("--ready", default=None, help="file to write once the socket is listening")
    ap.add_argument("--no-mount-ns", action="store_true", help="branches copy the workspace instead of mounting (host process)")
    ap.add_argument("--contain", action="store_true", help="sandbox: own namespaces, copy-on-write files, no privileges")
    ap.add_argument("--disk-mib", type=int, default=None, help="size of the machine's workspace + /tmp store")
    ap.add_argument("--net", action="store_true", help="tests only: share the host's network (SMOLBENCH_TEST_WEAKEN=net-share)")
    ap.add_argument("--keep", action="append", default=[], help="host path under /tmp bound in by the sandbox")
    ap.add_argument("--weaken", default="", help="tests only: containment steps to skip (seccomp, layers, branch-nproc, mount-guard, guard-maps, fd-reopen)")
    ap.add_argument("--grants-fd", type=int, default=None, help="contained: the host's pipe of branch store grants (mountguard.py)")
    ap.add_argument("--rlimit", action="append", default=[], help="NAME=VALUE, e.g. DATA=1073741824 (repeatable)")
    ap.add_argument("--no-pdeathsig", action="store_true",
                    help="outlive the launcher that started this process (smol backend), and so do branches")
    ap.add_argument("--pids", type=int, default=None,
                    help="contained, with RLIMIT_NPROC as the process cap: the machine's own count (and each branch's)")
    args = ap.parse_args(argv)
    if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:  # run as a script: cells can't import these modules
        del sys.path[0]
    privatefiles = _module("privatefiles")
    privatefiles.PDEATHSIG = not args.no_pdeathsig
    weak = [w for w in args.weaken.split(",") if w]
    rlimits = list(args.rlimit)
    if args.pids and ("branch-nproc" in weak or not args.contain):  # no room for branches (tests: the old set-up)
        rlimits = [r for r in rlimits if not r.startswith("NPROC=")] + ["NPROC=%d" % args.pids]
    _apply_rlimits(rlimits)
    if args.lib:
        sys.path.append(args.lib)
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
        os.chdir(args.workdir)
    sys.path.insert(0, args.workdir or os.getcwd())
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    privatefiles._set_pdeathsig()
    machine = None
    if args.contain:
        contain = _module("contain")
        if "net-caps" in args.weaken:  # tests only: keep CAP_NET_ADMIN and CAP_NET_RAW in the machine's netns
            contain.KEEP_CAPS = (1 << 12) | (1 << 13)
        machine = contain.start_root(args.workdir, args.disk_mib, args.net, args.keep, weak=weak, nproc=args.pids,
                                     grants_fd=args.grants_fd)
    _module("pipsite").setup(args.packages, args.workdir)  # after containment: its folder is in the machine's workspace
    _module("netnote").watch_connects()
    agent = _module("serving").Agent(args.socket, args.name, args.workdir)
    agent.mount_ns = not args.no_mount_ns
    agent.machine = machine
    agent._nproc_room(0)  # the root's hard limit has room for its branches; its soft, for itself
    if args.ready:
        with open(args.ready, "w") as fh:
            fh.write(str(os.getpid()))
    sys.__stdout__.write("smolbench agent %s ready (pid %d)\n" % (args.name, os.getpid()))
    sys.__stdout__.flush()
    agent.serve_forever()


if __name__ == "__main__":
    main()
