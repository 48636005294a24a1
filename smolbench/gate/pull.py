"""Values pulled from a machine (``--pull``), rebuilt from data without running code.

The agent sends a pulled value as a JSON tree: plain JSON for None, bools, numbers,
strings and lists; ``{"$": tag, ...}`` for the rest (dicts with any plain keys, tuples,
sets, bytes, complex and non-finite floats, numpy arrays as ``.npy`` read with
``allow_pickle=False``, pandas Series and DataFrames column by column). Nothing here
imports, calls or unpickles anything the machine names. Only with ``--pull-trusted`` or
``%smol trust on`` does a pickle sent by the machine get unpickled.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import pickle
import re
from typing import Any

from .frames import Bad, integer, mapping, shown, string

MAX_DEPTH = 100
DTYPE_RE = re.compile(r"[A-Za-z0-9_\[\], :/+\-]{1,64}")
FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _b64(value: Any, what: str) -> bytes:
    text = string(value, what, 2**31)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise Bad(f"{what} is not base64") from None


def _npy(value: Any) -> Any:
    import numpy as np

    try:
        return np.load(io.BytesIO(_b64(value, "an array")), allow_pickle=False)
    except Bad:
        raise
    except Exception as exc:  # numpy says why (object arrays need pickle: refused)
        raise Bad(f"an array that is not plain .npy data ({shown(str(exc))})") from None


def _column(enc: Any, depth: int) -> Any:
    enc = mapping(enc, "a pandas column", 4)
    values = enc.get("values")
    dtype = string(enc.get("dtype"), "a pandas dtype", 64)
    if not DTYPE_RE.fullmatch(dtype):
        raise Bad(f"a pandas dtype {shown(dtype)} is not a dtype name")
    import pandas as pd

    data = data_value(values, depth + 1)
    try:
        return pd.array(data, dtype=pd.api.types.pandas_dtype(dtype)) if dtype != "object" else data
    except Exception as exc:
        raise Bad(f"a pandas column of dtype {shown(dtype)} can't be rebuilt ({shown(str(exc))})") from None


def _index(enc: Any, depth: int) -> Any:
    import pandas as pd

    enc = mapping(enc, "a pandas index", 6)
    if enc.get("$") == "range":
        return pd.RangeIndex(integer(enc.get("start"), "start"), integer(enc.get("stop"), "stop"),
                             integer(enc.get("step"), "step") or 1, name=data_value(enc.get("name"), depth + 1))
    return pd.Index(_column(enc.get("values"), depth), name=data_value(enc.get("name"), depth + 1))


def data_value(tree: Any, depth: int = 0) -> Any:
    """Rebuild one value from its JSON tree (only the forms listed in the module doc)."""
    if depth > MAX_DEPTH:
        raise Bad("a pulled value nested too deeply")
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, list):
        return [data_value(v, depth + 1) for v in tree]
    if not isinstance(tree, dict):
        raise Bad(f"a pulled value of JSON type {type(tree).__name__}")
    tag = tree.get("$")
    v = tree.get("v")
    if tag == "dict":
        if not isinstance(v, list) or not all(isinstance(kv, list) and len(kv) == 2 for kv in v):
            raise Bad("a pulled dict that is not a list of key/value pairs")
        out = {}
        for k, val in v:
            key = data_value(k, depth + 1)
            try:
                out[key] = data_value(val, depth + 1)
            except TypeError:
                raise Bad(f"a pulled dict with an unhashable key {shown(key)}") from None
        return out
    if tag in ("tuple", "set", "frozenset"):
        if not isinstance(v, list):
            raise Bad(f"a pulled {tag} that is not a list")
        items = [data_value(x, depth + 1) for x in v]
        try:
            return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
        except TypeError:
            raise Bad(f"a pulled {tag} with an unhashable item") from None
    if tag == "bytes":
        return _b64(v, "pulled bytes")
    if tag == "float":
        if v not in FLOATS:
            raise Bad(f"a pulled float {shown(v)}")
        return FLOATS[v]
    if tag == "complex":
        if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)):
            raise Bad("a pulled complex number that is not [real, imag]")
        return complex(v[0], v[1])
    if tag == "npy":
        return _npy(v)
    if tag == "npscalar":
        return _npy(v)[()]
    if tag == "series":
        import pandas as pd

        tree = mapping(tree, "a pandas Series", 5)
        return pd.Series(_column(tree.get("values"), depth), index=_index(tree.get("index"), depth),
                         name=data_value(tree.get("name"), depth + 1), copy=False)
    if tag == "dataframe":
        import pandas as pd

        tree = mapping(tree, "a pandas DataFrame", 5)
        cols = data_value(tree.get("columns"), depth + 1)
        data = tree.get("data")
        if not isinstance(cols, list) or not isinstance(data, list) or len(cols) != len(data):
            raise Bad("a pulled DataFrame whose columns and data don't match")
        index = _index(tree.get("index"), depth)
        frame = pd.DataFrame({i: pd.Series(_column(c, depth), index=index, copy=False) for i, c in enumerate(data)},
                             index=index)
        frame.columns = pd.Index(cols, tupleize_cols=False) if cols else pd.RangeIndex(0)
        return frame
    raise Bad(f"a pulled value of unknown form {shown(tag)}")


def pulled(name: str, enc: Any, trusted: bool) -> Any:
    """One ``--pull`` value from its wire form: data, a refusal, or (trusted only) a pickle."""
    from ..errors import SmolbenchError

    enc = mapping(enc, f"--pull {name}", 4)
    form = enc.get("format")
    if form == "data":
        return data_value(enc.get("data"))
    if form == "refused":
        kind = string(enc.get("type"), "a type name", 200)
        kind = re.sub(r"[^A-Za-z0-9_.<>\[\], ]", "?", kind)
        raise SmolbenchError(
            f"--pull {name}: a {kind} is not plain data, so it is not unpickled on this host (that would run code "
            f"from the machine here): turn it into builtins, arrays or pandas objects in the machine, or use "
            f"--pull-trusted (or `%smol trust on`) to unpickle it anyway")
    if form == "pickle":
        if not trusted:
            raise Bad(f"--pull {name} came back as a pickle, but pulls are data-only (no --pull-trusted)")
        blob = _b64(enc.get("data"), f"--pull {name}")
        try:
            return pickle.loads(blob)  # the user opted in: --pull-trusted / %smol trust on
        except Exception as exc:
            raise SmolbenchError(f"--pull {name}: its pickle can't be loaded here ({type(exc).__name__}: {exc}): "
                                 "is the same library installed in the notebook?") from None
    raise Bad(f"--pull {name} has an unknown format {shown(form)}")
