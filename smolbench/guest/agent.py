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

import importlib
import os
import signal
import sys
import types

_HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = "_smolbench_guest"


def _package():
    """This folder as the package ``_smolbench_guest`` (made once per process)."""
    pkg = sys.modules.get(PACKAGE)
    if pkg is None:
        pkg = types.ModuleType(PACKAGE)
        pkg.__path__ = [_HERE]  # a package: its submodules are found in this folder
        pkg.__package__ = PACKAGE
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


# The host's command line (never a person's): option -> (attribute, kind, default). A small parser
# of its own, not argparse: argparse and what it imports are a third of the agent's start-up.
OPTIONS = {
    "--socket": ("socket", str, None),
    "--name": ("name", str, "root"),
    "--workdir": ("workdir", str, None),
    "--lib": ("lib", str, None),  # extra import path appended to sys.path (cloudpickle)
    "--packages": ("packages", str, None),  # the Smolfile's packages (a read-only folder) for sys.path
    "--ready": ("ready", str, None),  # file to write once the socket is listening
    "--no-mount-ns": ("no_mount_ns", bool, False),  # branches copy the workspace instead of mounting (host process)
    "--contain": ("contain", bool, False),  # sandbox: own namespaces, copy-on-write files, no privileges
    "--disk-mib": ("disk_mib", int, None),  # size of the machine's workspace + /tmp store
    "--net": ("net", bool, False),  # tests only: share the host's network (SMOLBENCH_TEST_WEAKEN=net-share)
    "--keep": ("keep", list, None),  # host path under /tmp bound in by the sandbox (repeatable)
    # tests only: containment steps to skip (seccomp, layers, branch-nproc, mount-guard, guard-maps, fd-reopen)
    "--weaken": ("weaken", str, ""),
    "--grants-fd": ("grants_fd", int, None),  # contained: the host's pipe of branch store grants (mountguard.py)
    "--rlimit": ("rlimit", list, None),  # NAME=VALUE, e.g. DATA=1073741824 (repeatable)
    # outlive the launcher that started this process (smol backend), and so do branches
    "--no-pdeathsig": ("no_pdeathsig", bool, False),
    # contained, with RLIMIT_NPROC as the process cap: the machine's own count (and each branch's)
    "--pids": ("pids", int, None),
}


def parse_args(argv):
    """The agent's options (``OPTIONS``: ``--opt VALUE`` or ``--opt=VALUE``); exits with one line on a bad one."""
    args = types.SimpleNamespace(**{attr: [] if kind is list else default for attr, kind, default in OPTIONS.values()})
    items = list(argv)
    while items:
        item = items.pop(0)
        opt, eq, value = item.partition("=")
        if opt not in OPTIONS:
            sys.exit("agent.py: unknown option %r (usage: %s)" % (item, __doc__.strip().splitlines()[-1]))
        attr, kind, _ = OPTIONS[opt]
        if kind is bool:
            if eq:
                sys.exit("agent.py: %s takes no value" % opt)
            setattr(args, attr, True)
            continue
        if not eq:
            if not items:
                sys.exit("agent.py: %s needs a value" % opt)
            value = items.pop(0)
        if kind is list:
            getattr(args, attr).append(value)
        else:
            try:
                setattr(args, attr, kind(value))
            except ValueError:
                sys.exit("agent.py: %s needs a whole number, not %r" % (opt, value))
    if args.socket is None:
        sys.exit("agent.py: --socket is required")
    return args


def main(argv=None):
    """Start the agent and serve until killed."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
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
    _module("pipsite").setup(args.packages, args.workdir, args.disk_mib)  # after containment: its folder is in the machine's workspace
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
