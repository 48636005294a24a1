"""``--pull`` values as data trees the host rebuilds without running code, and the pickles a
trusted pull, a push and a checkpoint use.

Stdlib only, Python 3.8+: runs inside the machine (see ``agent.py``).
"""

import io
import math
import pickle
import sys

from . import protocol as P


class _NotData(Exception):
    """A value that has no data-only form (its type name is the message)."""


def _type_name(value):
    t = type(value)
    return "%s.%s" % (t.__module__, t.__qualname__) if t.__module__ != "builtins" else t.__qualname__


_HEADERS = {}  # type: dict
# (dtype, shape) -> the .npy header np.save writes for it (plain C-ordered arrays)


def _npy(arr):
    np = sys.modules["numpy"]
    if arr.dtype.hasobject:
        raise _NotData("numpy array of Python objects")
    if arr.dtype.kind in "biuf" and arr.flags.c_contiguous and arr.dtype.fields is None:
        key = (arr.dtype.str, arr.shape)
        head = _HEADERS.get(key)
        if head is None:  # the same bytes np.save writes, made once per layout (a step's obs each time)
            buf = io.BytesIO()
            np.lib.format.write_array_header_1_0(buf, np.lib.format.header_data_from_array_1_0(arr))
            head = buf.getvalue()
            if len(_HEADERS) < 64:
                _HEADERS[key] = head
        return P.b64(head + arr.tobytes())
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return P.b64(buf.getvalue())


def _pd_column(values, dtype):
    np = sys.modules["numpy"]
    arr = np.asarray(values)
    if not arr.dtype.hasobject and arr.dtype.kind != "O":
        return {"dtype": str(dtype), "values": {"$": "npy", "v": _npy(arr)}}
    pd = sys.modules["pandas"]
    items = [None if (not isinstance(x, (list, tuple, dict)) and pd.isna(x)) else x for x in list(values)]
    return {"dtype": str(dtype), "values": [_data(x, 1) for x in items]}


def _pd_index(index):
    pd = sys.modules["pandas"]
    if type(index) is pd.RangeIndex:
        return {"$": "range", "start": index.start, "stop": index.stop, "step": index.step, "name": _data(index.name, 1)}
    if isinstance(index, pd.MultiIndex):
        raise _NotData("pandas MultiIndex")
    return {"values": _pd_column(index, index.dtype), "name": _data(index.name, 1)}


def _data(value, depth=0):
    """``value`` as a JSON data tree the host rebuilds without running code (see smolbench/gate/pull.py)."""
    if depth > 100:
        raise _NotData("value nested more than 100 levels deep")
    t = type(value)
    if value is None or t in (bool, str, int):
        return value
    if t is float:
        return value if math.isfinite(value) else {"$": "float", "v": repr(value)}
    if t is list:
        return [_data(v, depth + 1) for v in value]
    if t in (tuple, set, frozenset):
        items = list(value)
        return {"$": t.__name__, "v": [_data(v, depth + 1) for v in items]}
    if t is dict:
        return {"$": "dict", "v": [[_data(k, depth + 1), _data(v, depth + 1)] for k, v in value.items()]}
    if t in (bytes, bytearray):
        return {"$": "bytes", "v": P.b64(bytes(value))}
    if t is complex:
        return {"$": "complex", "v": [value.real, value.imag]}
    np = sys.modules.get("numpy")
    if np is not None and t is np.ndarray:
        return {"$": "npy", "v": _npy(value)}
    if np is not None and isinstance(value, np.generic):
        return {"$": "npscalar", "v": _npy(np.asarray(value))}
    pd = sys.modules.get("pandas")
    if pd is not None and t is pd.Series:
        return {"$": "series", "values": _pd_column(value.array, value.dtype), "index": _pd_index(value.index),
                "name": _data(value.name, depth + 1)}
    if pd is not None and t is pd.DataFrame:
        if isinstance(value.columns, pd.MultiIndex):
            raise _NotData("pandas DataFrame with MultiIndex columns")
        return {"$": "dataframe", "columns": [_data(c, depth + 1) for c in value.columns],
                "index": _pd_index(value.index),
                "data": [_pd_column(value.iloc[:, i].array, value.dtypes.iloc[i]) for i in range(value.shape[1])]}
    raise _NotData(_type_name(value))


def _pull(value, trusted):
    """A ``--pull`` value in its wire form: data if it can be, else a pickle (trusted) or a refusal."""
    try:
        return {"format": "data", "data": _data(value)}
    except _NotData as exc:
        if trusted:
            return {"format": "pickle", "data": P.b64(_dumps(value))}
        return {"format": "refused", "type": str(exc)[:200]}


def _dumps(value):
    try:
        import cloudpickle  # shipped beside the agent; pickles cell-defined functions
    except ImportError:
        return pickle.dumps(value, protocol=4)
    return cloudpickle.dumps(value, protocol=4)


def _loads(blob):
    return pickle.loads(blob)

