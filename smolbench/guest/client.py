"""Relay one request to the agent and print its replies (used inside a microVM).

The host cannot reach a Unix socket inside a microVM, but it can run a short
command and stream its output: ``python3 client.py SOCKET`` reads one request
line on stdin, sends it to the agent, and copies every reply line to stdout as
it arrives. Stdlib only.
"""

import socket
import sys


def main(argv=None):
    """Relay stdin's request to the agent at argv[1]; exit 0 when it is done."""
    argv = sys.argv if argv is None else argv
    path = argv[1]
    request = sys.stdin.buffer.readline()
    if not request.strip():  # the agent would wait for it forever
        sys.stdout.write('{"t":"done","status":"error","error":{"ename":"EmptyRequest",'
                         '"evalue":"the relay got no request on stdin","traceback":[]}}\n')
        return 4
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except OSError as exc:
        sys.stdout.write('{"t":"done","status":"error","error":{"ename":"AgentUnreachable",'
                         '"evalue":"no agent at %s: %s","traceback":[]}}\n' % (path, exc))
        return 3
    s.sendall(request)
    out = sys.stdout.buffer
    f = s.makefile("rb")
    for line in f:
        out.write(line)
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
