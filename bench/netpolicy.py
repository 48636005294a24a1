"""What the network policy costs on the sandbox (issue 19).

    python -m bench.netpolicy [--rounds N]   # writes bench/results/netpolicy.json, regenerates RESULTS.md

* ``download``: 100 MB over HTTP from a server on this host's loopback (127.0.0.2, listed in
  the machine's allow-list by address and port), read in 1 MiB pieces by the same Python code
  (a) on the host, (b) in a sandbox machine through its egress proxy (``HTTP_PROXY``), and
  (c) in the machine over raw TCP (the proxy's listener for a listed address), interleaved.
* ``up``: ``backend.create`` of a machine with the network off and with an allow-list,
  interleaved (the proxy process itself starts once per kernel: timed separately), and a
  fork of 16 with both (each branch gets its own listeners).
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from bench.common import RESULTS, machine_info  # noqa: E402

SIZE = 100 * 1000 * 1000
PIECE = bytes(range(256)) * 4096  # 1 MiB


class _Big(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Length", str(SIZE))
        self.end_headers()
        left = SIZE
        view = memoryview(PIECE)
        while left:
            n = min(left, len(PIECE))
            self.wfile.write(view[:n])
            left -= n

    def log_message(self, *args: Any) -> None:
        pass


def _download_code(url: str, proxied: bool) -> str:
    opener = "urllib.request.build_opener()" if proxied else "urllib.request.build_opener(urllib.request.ProxyHandler({}))"
    return (f"import time, urllib.request\nt = time.perf_counter(); n = 0\n"
            f"with {opener}.open({url!r}) as r:\n"
            "    while True:\n        b = r.read(1 << 20)\n        if not b: break\n        n += len(b)\n"
            "(n, time.perf_counter() - t)")


async def _measure(rounds: int, run_dir: str, url: str, port: int) -> dict[str, Any]:
    from smolbench.backends.base import CellRequest
    from smolbench.backends.sandbox import SandboxBackend
    from smolbench.spec import MachineSpec

    allow = MachineSpec(allow_cidrs=(f"127.0.0.2/32:{port}",))
    off = MachineSpec()
    out: dict[str, list[float]] = {k: [] for k in ("host", "proxy", "raw", "create_off", "create_allow",
                                                  "fork16_off", "fork16_allow")}

    async def cell(b: SandboxBackend, ref: Any, code: str) -> Any:
        res = await b.exec_cell(ref, CellRequest(code), lambda e: None)
        assert res.status == "ok", res.error
        return eval((res.result or {})["text/plain"])  # our own cell's tuple of numbers

    b = SandboxBackend(runtime_dir=run_dir)
    try:
        t0 = time.perf_counter()
        first = await b.create(allow, "first")
        proxy_start = time.perf_counter() - t0
        await b.delete(first)
        ref = await b.create(allow, "dl")
        for r in range(rounds):
            order = ["host", "proxy", "raw"] if r % 2 == 0 else ["raw", "proxy", "host"]
            for way in order:
                if way == "host":
                    code = _download_code(url, False).rsplit("\n", 1)[0] + "\nprint((n, time.perf_counter() - t))"
                    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                    n, secs = eval(proc.stdout)
                else:
                    n, secs = await cell(b, ref, _download_code(url, way == "proxy"))
                assert n == SIZE, (way, n)
                out[way].append(SIZE / secs / 1e6)
            for kind, spec in (("off", off), ("allow", allow)) if r % 2 == 0 else (("allow", allow), ("off", off)):
                t0 = time.perf_counter()
                m = await b.create(spec, f"m{r}{kind}")
                out[f"create_{kind}"].append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                kids = await b.branch(m, [f"m{r}{kind}.{i}" for i in range(16)], list(range(16)))
                await asyncio.gather(*(b.exec_cell(k, CellRequest("SEED"), lambda e: None) for k in kids))
                out[f"fork16_{kind}"].append((time.perf_counter() - t0) * 1e3)
                await b.delete(m)
    finally:
        await b.close()
    res: dict[str, Any] = {"proxy_start_ms": proxy_start * 1e3}
    for key, vals in out.items():
        res[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}
    return res


def run(rounds: int = 5) -> dict[str, Any]:
    server = http.server.ThreadingHTTPServer(("127.0.0.2", 0), _Big)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    load = os.getloadavg()[0]
    try:
        with tempfile.TemporaryDirectory(prefix="bench-net-") as run_dir:
            results = asyncio.run(_measure(rounds, run_dir, f"http://127.0.0.2:{port}/big", port))
    finally:
        server.shutdown()
        server.server_close()
    return {"machine": machine_info("sandbox"), "rounds": rounds, "results": results,
            "load_avg": [load, os.getloadavg()[0]]}


def section(d: dict[str, Any]) -> list[str]:
    """The RESULTS.md section for ``netpolicy.json``."""
    r = d["results"]

    def mbs(key: str, what: str) -> str:
        v = r[key]
        return f"| {what} | {v['median']:.0f} | {v['min']:.0f}–{v['max']:.0f} | {v['median'] / r['host']['median']:.2f} |"

    def ms(key: str) -> str:
        return f"{r[key]['median']:.0f} (min {r[key]['min']:.0f})"

    return [
        "## Network policy · what the egress proxy costs (issue 19)", "",
        f"`python -m bench.netpolicy`, {d['machine']['date'][:16]}, {d['rounds']} interleaved rounds, sandbox backend, "
        "host load average {:.1f} then {:.1f} on {} cores. A 100 MB HTTP download from a server on this host's "
        "loopback (127.0.0.2, listed by address and port), read in 1 MiB pieces by the same Python code.".format(
            *d.get("load_avg", [0, 0]), d["machine"].get("cores", "?")), "",
        "| 100 MB download | MB/s (median) | range | vs host |", "|---|---:|---:|---:|",
        mbs("host", "on the host"),
        mbs("proxy", "in a machine, through its egress proxy (`HTTP_PROXY`)"),
        mbs("raw", "in a machine, raw TCP to the listed address (the proxy relays it)"), "",
        "| ms (median) | network off | allow-list | difference |", "|---|---:|---:|---:|",
        f"| create a machine (`%smol up`'s backend part) | {ms('create_off')} | {ms('create_allow')} | "
        f"{r['create_allow']['median'] - r['create_off']['median']:+.0f} |",
        f"| fork 16, all running | {ms('fork16_off')} | {ms('fork16_allow')} | "
        f"{r['fork16_allow']['median'] - r['fork16_off']['median']:+.0f} |", "",
        f"The proxy process starts once per kernel, with the first machine that has a network: that first create took "
        f"{r['proxy_start_ms']:.0f} ms in all. Each machine and branch then costs one forked helper that joins its "
        "namespaces and binds the listeners.", "",
    ]


def main() -> int:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 5
    data = run(rounds)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "netpolicy.json").write_text(json.dumps(data, indent=2))
    from bench import report

    print("\n".join(section(data)))
    print(report.write())
    return 0


if __name__ == "__main__":
    sys.exit(main())
