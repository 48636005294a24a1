"""A machine's share of the counts the host keeps per uid (issue 17, second audit).

Stdlib only (runs on the machine's python3). Every machine of a kernel runs as one host uid
(as root, the sandbox uid of every root kernel on the host; as a user, the user's own), and
the kernel keeps some counts per uid: descriptors in flight on Unix sockets, inotify
instances and watches, namespaces. What is set here keeps one machine from using them up
for the others (docs/security.md, "Counts the host keeps per uid").
"""

import resource

# Per user-namespace limits (ucounts): how much of the counts the host keeps per uid (shared
# by every machine of that uid and, as a user kernel, the user's own processes) a machine's
# subtree may hold. A root's room is its own plus 32 full branches', like RLIMIT_NPROC's.
# A branch may hold namespaces for 128 branches of its own (each takes one of each kind):
# a gym env's warm parent has one per sub-env plus spares and ones being deleted. The
# root's count still bounds its whole tree.
NAMESPACE_KINDS = ("user", "mnt", "pid", "ipc", "net", "uts", "cgroup", "time")
BRANCH_NAMESPACES = 128
ROOT_NAMESPACES = 32 * 33
BRANCH_UCOUNTS = dict({"max_inotify_instances": 8, "max_inotify_watches": 8192},
                      **{"max_%s_namespaces" % k: BRANCH_NAMESPACES for k in NAMESPACE_KINDS})
ROOT_UCOUNTS = dict({"max_inotify_instances": 32, "max_inotify_watches": 32768},
                    **{"max_%s_namespaces" % k: ROOT_NAMESPACES for k in NAMESPACE_KINDS})
NOFILE_ROOM = 1024  # the keeper's descriptor limit stays this far above its agent's


def _write(path, text):
    with open(path, "w") as fh:
        fh.write(text)


def limit_ucounts(limits):
    """Agent, before it drops its capabilities: this machine's ucount limits, in its own user
    namespace. The kernel checks a count against the limit of every namespace above too, so a
    branch's count is within its parent's, and the root's bounds its whole tree."""
    for name, value in limits.items():
        try:
            _write("/proc/sys/user/" + name, str(value))
        except OSError:
            pass  # an older kernel without that count


def lower_nofile(start):
    """Root agent: its RLIMIT_NOFILE (``start``: the one it was started with) below its
    keeper's (soft and hard: the hard one it was started with). The kernel refuses to pass a
    descriptor while the sender's uid has more in flight than the sender's own soft limit,
    and a machine can put at most its own limit (and one message) in flight: so the root's
    keeper can still pass the layers at a fork, whatever any machine of that uid holds."""
    soft, hard = start
    if hard == resource.RLIM_INFINITY or hard <= 2 * NOFILE_ROOM:
        resource.setrlimit(resource.RLIMIT_NOFILE, start)
        return
    low = min(hard - NOFILE_ROOM, 65536)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, low), low))
