"""The gate's fast path for plain .npy arrays (a gym step's observations): it must rebuild
exactly what np.load(allow_pickle=False) does, and anything it doesn't match whole goes to
np.load, which refuses what is not plain data.

The attacks are forged .npy bytes a machine could send: a header that claims more items
than were sent, one that claims fewer, an object dtype (would need a pickle), a header with
extra Python in it, a version 2 header.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest

from smolbench.gate import pull
from smolbench.gate.frames import Bad


def npy(arr: Any) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def forged(header: str, body: bytes) -> str:
    text = header.encode("latin1")
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    return base64.b64encode(b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + body).decode()


@pytest.mark.parametrize("arr", [
    np.zeros(4, np.float32), np.arange(6, dtype=np.int64).reshape(2, 3), np.array(3.5), np.zeros((0, 3)),
    np.array([True, False]), np.arange(5, dtype=">i4"), np.zeros((1, 2, 3, 4), np.uint8), np.array([-1, 7], np.int8),
    np.asfortranarray(np.arange(6.0).reshape(2, 3)), np.array(["ab"]), np.zeros(3, np.complex64), np.zeros(3, np.float16),
])
def test_the_fast_path_rebuilds_what_np_load_does(arr: Any) -> None:
    raw = npy(arr)
    want = np.load(io.BytesIO(raw), allow_pickle=False)
    got = pull.npy(base64.b64encode(raw).decode())
    assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
    assert got.flags.writeable  # as np.load's: the env's code may write to its observation


@pytest.mark.parametrize("header, body", [
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (1000000,), }", b"\0" * 16),  # more items than sent
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999, 99999999999), }", b"\0" * 16),
    ("{'descr': '|O', 'fortran_order': False, 'shape': (1,), }", b"\x80\x04N."),  # would need a pickle
    ("{'descr': '<f4', 'fortran_order': False, 'shape': (__import__('os').getpid(),), }", b"\0" * 16),
    ("{'descr': '<b8', 'fortran_order': False, 'shape': (2,), }", b"\0" * 16),  # no such dtype: was a TypeError
    ("{'descr': '|f1', 'fortran_order': False, 'shape': (2,), }", b"\0" * 2),
])
def test_forged_headers_are_refused(header: str, body: bytes) -> None:
    with pytest.raises(Bad, match="not plain .npy data"):
        pull.npy(forged(header, body))


def test_a_header_claiming_fewer_items_than_sent_is_not_taken_by_the_fast_path() -> None:
    enc = forged("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", b"\0" * 16)
    assert pull._plain_npy(base64.b64decode(enc)) is None  # np.load decides (it reads the 2 it was told)
    assert pull.npy(enc).shape == (2,)
