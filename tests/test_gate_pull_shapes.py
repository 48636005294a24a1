"""Pulled values that are small on the wire but cost the host (round 4's own audit).

A set's items and a dict's keys are hashed as the host rebuilds them, and numbers (and tuples
of them) hash alike in every process: 40,000 multiples of 2**61 - 1 (a 1 MB reply) took 8.6 s
in one C call on the kernel's loop, a million an hour. A pandas dtype's time zone named
``dateutil/<path>`` made the host open that path. Both are refused in one line, before the
cost; each is shown getting through with its check taken out.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from smolbench.gate import pull
from smolbench.gate.frames import Bad

M = 2**61 - 1  # ints k * M all hash to 0


@pytest.mark.parametrize("tag", ["set", "frozenset", "dict"])
def test_items_made_to_share_one_hash_are_refused_before_they_are_hashed_in(tag: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    items: list[Any] = [k * M for k in range(1, 2001)]
    tree = {"$": tag, "v": [[k, 1] for k in items] if tag == "dict" else items}
    with pytest.raises(Bad, match=f"a pulled {tag} of 2,000 items, 2,000 of them with one hash"):
        pull.data_value(tree)
    # honest sets and dicts of any size, and a few collisions, are rebuilt as they were
    assert len(pull.data_value({"$": tag, "v": [[k, 1] for k in range(50_000)] if tag == "dict"
                                else list(range(50_000))})) == 50_000
    assert len(pull.data_value({"$": tag, "v": [[k * M, 1] for k in range(1, 17)] if tag == "dict"
                                else [k * M for k in range(1, 17)]})) == 16
    monkeypatch.setattr(pull, "_spread", lambda keys, what: None)  # weakened: every insert probes the others
    assert len(pull.data_value(tree)) == 2000


def test_a_time_zone_naming_a_path_is_refused_before_pandas_opens_it(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("pandas")
    opened: list[str] = []
    watching = [False]

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if watching[0] and event == "open" and isinstance(args[0], str) and "hostname" in args[0]:
            opened.append(args[0])

    sys.addaudithook(hook)  # stays for the process: it records only while watching
    # (outside audit: the check matched only names that start "datetime64[")
    names = ["datetime64[ns, dateutil//etc/hostname]", "M8[ns, dateutil//etc/hostname]",
             "interval[datetime64[ns, dateutil//etc/hostname]]"]
    watching[0] = True
    try:
        for name in names:
            with pytest.raises(Bad, match="with a time zone that is not a tz database name"):
                pull._dtype(name)
        assert opened == []
        for ok in ("datetime64[ns, UTC]", "datetime64[ns, Europe/Paris]", "datetime64[ns, UTC+05:00]", "M8[ns, UTC]",
                   "interval[datetime64[ns, UTC], right]"):
            pull._dtype(ok)
        monkeypatch.setattr(pull, "_zones_named", lambda name: True)  # weakened: no time zone check
        for name in names:
            opened.clear()
            with pytest.raises(Bad):
                pull._dtype(name)
            assert opened, f"pandas opened nothing for {name}: not a contrast"
    finally:
        watching[0] = False


@pytest.mark.parametrize("name", ["Sparse[10000000f8]", "Sparse[V10000000]", "interval[1000000f8]", "interval[V1000000]"])
def test_a_pandas_dtype_wrapping_a_huge_numpy_one_is_refused(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside audit: 180 bytes naming a Sparse column of 10,000,000-float items made the host
    allocate 80 MB per value sent (three values: 240 MB)."""
    pytest.importorskip("pandas")
    enc = {"$": "series", "index": {"$": "range", "start": 0, "stop": 3, "step": 1},
           "values": {"dtype": name, "values": [0, 0, 0]}}
    with pytest.raises(Bad, match="pandas holds no such column"):
        pull.data_value(enc, 0, pull.Budget())
    for ok in ("Sparse[float64, nan]", "interval[int64, right]", "Int64", "boolean", "category"):
        pull._dtype(ok)
    if name.startswith("Sparse"):  # weakened: the numpy check alone, as before
        monkeypatch.setattr(pull, "_small_items", lambda dtype: True)
        assert pull.data_value(enc, 0, pull.Budget()).nbytes > 3 * 1_000_000  # from 3 zeros sent


def test_a_category_column_made_to_share_one_hash_is_refused() -> None:
    """pandas finds a category column's categories by hashing every value: 11,107 multiples of
    2**61 - 1 (256 KiB) held the loop 1.2 s, a million would take hours."""
    from smolbench.gate import pull
    from smolbench.gate.frames import Bad

    n = 11_107
    enc = {"$": "series", "index": {"$": "range", "start": 0, "stop": n, "step": 1},
           "values": {"dtype": "category", "values": [k * (2**61 - 1) for k in range(1, n + 1)]}}
    with pytest.raises(Bad, match="a pulled category column of 11,107 items, 11,107 of them with one hash"):
        pull.data_value(enc, 0, pull.Budget())
    fine = {"$": "series", "index": {"$": "range", "start": 0, "stop": 3, "step": 1},
            "values": {"dtype": "category", "values": ["a", "b", "a"]}}
    assert pull.data_value(fine, 0, pull.Budget()).tolist() == ["a", "b", "a"]


def test_a_reply_rebuilds_at_most_so_many_pandas_columns() -> None:
    """Each pandas column costs ~100 us of pandas holding the GIL however small its data:
    256 KiB of empty category columns took a second."""
    from smolbench.gate import pull
    from smolbench.gate.frames import Bad

    def frame(n: int) -> dict[str, Any]:
        return {"$": "dataframe", "columns": list(range(n)), "data": [{"dtype": "category", "values": []}] * n,
                "index": {"$": "range", "start": 0, "stop": 0, "step": 1}}

    with pytest.raises(Bad, match="more than 4,096 pandas columns in one reply"):
        pull.data_value(frame(5_000), 0, pull.Budget())
    assert pull.data_value(frame(100), 0, pull.Budget()).shape == (0, 100)


def _npy_b64(arr: Any) -> str:
    import base64
    import io

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("shape", [(5_000_000, 0), (1, 2_000_000, 0), (3000, 3000, 0)])
def test_an_array_whose_shape_is_millions_of_lists_for_no_data_is_refused(shape: tuple[int, ...],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Fourth round's last audit: 128 bytes of .npy of shape (5,000,000, 0) passed (no items,
    so none outnumbered the bytes sent), and ``tolist`` in ``smolbench serve`` made 5 million
    lists of it: 700 MB and 5-15 s of the server's CPU per step, other sessions waiting."""
    np = pytest.importorskip("numpy")
    sent = _npy_b64(np.zeros(shape, np.uint8))
    assert len(sent) < 200
    with pytest.raises(Bad, match=r"nested lists for 0 items \(its shape describes far more than its data\)"):
        pull.npy(sent)
    # honest shapes pass: an image's channel, trailing ones, empty arrays
    for ok in [(256, 256, 1), (64, 64, 1, 1, 1), (0,), (3, 0, 2), (100, 0), (1000, 1)]:
        assert pull.npy(_npy_b64(np.zeros(ok, np.float32))).shape == ok
    monkeypatch.setattr(pull, "SHAPE_SLACK", 10**12)  # weakened: the shape unchecked
    assert pull.npy(sent).shape == shape
