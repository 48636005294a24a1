"""Scale out over a Ray cluster: one node agent per Ray node owns that node's machines.

address.py    joining a cluster (``%smol up --ray [ADDRESS]``, ``auto``, RAY_ADDRESS; no ``ray://``)
local.py      a throwaway multi-node Ray cluster on this machine (``smolbench cluster local``)
agent.py      the node agent: a Ray actor pinned to its node; moves raw machine bytes only
batch.py      one agent call per node for many machines' requests (cells, boots, deletes)
placement.py  which node runs which branches (contiguous batches by machine slots)
replica.py    a warm parent on another node: its recorded path replayed, checked by fingerprint
backend.py    ClusterBackend: the Backend protocol on the driver; every byte goes to the gate here
"""

SLOTS = "smolbench_slots"  # the custom Ray resource: how many machines a node may run at once
