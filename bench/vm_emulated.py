"""Real smol microVMs under emulation (run inside the lane's L1 guest by tests/vm/run.sh).

    python bench/vm_emulated.py OUT.json

Times smolbench's own smol backend on one machine: create (boot + agent start),
a trivial cell's round trip, ``branch`` x4 (one ``branch_batch`` plus seeding) and
deleting everything. The host is QEMU software emulation with nested SVM, roughly
50x slower than hardware: these numbers are NOT comparable to a KVM host; they say
what the lane costs and where the time goes. Nothing asserts them.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import sys
import time

from smolbench.backends.base import CellRequest
from smolbench.backends.smol import SmolBackend
from smolbench.spec import MachineSpec

IMAGE = os.environ.get("SMOLBENCH_TEST_SMOL_IMAGE", "/srv/pyimg")
EXECS = 10


async def measure() -> dict[str, object]:
    backend = SmolBackend(probe=False, session="bench")
    spec = MachineSpec(image=IMAGE, memory=512)
    out: dict[str, object] = {}
    try:
        t = time.perf_counter()
        root = await backend.create(spec, "root")
        out["create_s"] = time.perf_counter() - t
        trips = []
        for _ in range(EXECS):
            t = time.perf_counter()
            res = await backend.exec_cell(root, CellRequest(code="1"), lambda event: None)
            trips.append(time.perf_counter() - t)
            assert res.status == "ok", res.error
        out["exec_roundtrip_s"] = {"median": statistics.median(trips), "min": min(trips), "n": EXECS}
        t = time.perf_counter()
        kids = await backend.branch(root, [f"root.{i}" for i in range(4)], [0, 1, 2, 3])
        out["branch4_s"] = time.perf_counter() - t
        t = time.perf_counter()
        await asyncio.gather(*(backend.exec_cell(k, CellRequest(code="SEED"), lambda e: None) for k in kids))
        out["branch4_first_cell_s"] = time.perf_counter() - t
    finally:
        t = time.perf_counter()
        await backend.close()
        out["delete_all_s"] = time.perf_counter() - t
    return out


def main() -> None:
    result = asyncio.run(measure())
    result["machine"] = {
        "what": "QEMU TCG (software emulation), -cpu EPYC-Rome,+svm,+npt, -smp 1; smol microVM nested in it",
        "l1_kernel": platform.release(),  # the emulated host's; the microVMs run smol's own 6.18
        "cpus": os.cpu_count(),
        "image": IMAGE,
        "memory_mib": 512,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    with open(sys.argv[1], "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
