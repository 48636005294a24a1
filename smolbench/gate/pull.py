"""Values pulled from a machine (``--pull``), rebuilt from data without running code.

The agent sends a pulled value as a JSON tree: plain JSON for None, bools, numbers,
strings and lists; ``{"$": tag, ...}`` for the rest (dicts with any plain keys, tuples,
sets, bytes, complex and non-finite floats, numpy arrays as ``.npy`` read with
``allow_pickle=False``, pandas Series and DataFrames column by column, each column a list
or 1-D array as long as its index: nothing is broadcast to more than was sent). Nothing here
imports, calls or unpickles anything the machine names. Only with ``--pull-trusted`` or
``%smol trust on`` does a pickle sent by the machine get unpickled.
"""

from __future__ import annotations

import base64
import binascii
import collections
import functools
import io
import math
import pickle
import re
from typing import Any

from .frames import SURROGATE, Bad, integer, mapping, shown, string
from .limits import LIMITS, human

MAX_DEPTH = 100
DTYPE_RE = re.compile(r"[A-Za-z0-9_\[\], :/+\-]{1,64}")
FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
SHAPE_LISTS, SHAPE_SLACK = 4, 1024  # nested lists an array may describe: 4 per item, and 1,024 more
COLUMNS = 4096  # pandas columns (and indexes) one reply may rebuild
COLLISIONS = 16  # pulled items that may share one hash (64 per hash in 15,000 groups held the GIL 1.4 s)
TZ_IN_DTYPE = re.compile(r"(?:datetime64|M8)\[\s*\w+\s*,\s*([^\]]*)\]")  # anywhere: interval[M8[ns, X]] too
FIXED_OFFSET = re.compile(r"(UTC)?[+-]\d\d:?\d\d")


def _b64(value: Any, what: str) -> bytes:
    text = string(value, what, 2**31)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise Bad(f"{what} is not base64") from None


class Budget:
    """What one reply's pulled values may build beyond the JSON they came in: the rows of
    their range indexes (which columns must then match), counted as the JSON values and
    bytes they would take as data, against the same limits as the reply itself."""

    def __init__(self) -> None:
        self.held = 0
        self.columns = 0

    def column(self) -> None:
        """One more pandas column (a Series each): ~100 us of pandas, holding the GIL, however
        small its data (256 KiB of empty category columns took a second)."""
        self.columns += 1
        if self.columns > COLUMNS:
            raise Bad(f"more than {COLUMNS:,} pandas columns in one reply: pull fewer at a time")

    def rows(self, n: int) -> None:
        self.held += n
        what = f"a pandas index of {n:,} rows" if n == self.held else f"pandas indexes of {self.held:,} rows in all"
        if self.held > LIMITS.max_items:
            raise Bad(f"{what}, above the limit of {LIMITS.max_items:,} JSON values for one reply "
                      "(`%smol config max-items N` raises it)")
        if 2 * self.held > LIMITS.max_frame:  # as data, each row is at least a digit and a comma
            raise Bad(f"{what}, {human(2 * self.held)} or more as data, above the limit of "
                      f"{human(LIMITS.max_frame)} for one reply (`%smol config max-frame SIZE` raises it)")


# The header np.save writes for a C-ordered array of plain numbers (what an env's observation
# is): matched whole, no literal_eval, so a step's arrays skip numpy's header parser. Any
# other .npy goes through np.load(allow_pickle=False).
PLAIN_NPY = re.compile(rb"\{'descr': '([<>|](?:b1|[iu][1248]|f[248]))', 'fortran_order': False, "
                       rb"'shape': \(((?:[0-9]{1,10}, )*[0-9]{1,10},?|)\), \} *\n")


_HEADERS: dict[bytes, tuple[Any, tuple[int, ...], int]] = {}  # plain headers seen: (dtype, shape, items)


def _plain_npy(raw: bytes) -> Any:
    """A plain numeric C-ordered array from its .npy bytes, or None (then np.load decides)."""
    import numpy as np

    if len(raw) < 10 or raw[:8] != b"\x93NUMPY\x01\x00":
        return None
    end = 10 + int.from_bytes(raw[8:10], "little")
    header = raw[10:end]
    known = _HEADERS.get(header)
    if known is None:
        m = PLAIN_NPY.fullmatch(header)
        if m is None:
            return None
        try:
            dtype = np.dtype(m[1].decode("ascii"))
        except TypeError:  # a spelling numpy refuses: np.load's to refuse, in one line
            return None
        shape = tuple(int(x) for x in m[2].split(b",") if x.strip())
        known = (dtype, shape, math.prod(shape))
        if nested_lists(shape) > SHAPE_LISTS * known[2] + SHAPE_SLACK:
            return None  # np.load's path refuses it (_shape_ok), in one line
        if len(_HEADERS) < 64:  # a step's observation has the same header every time
            _HEADERS[header] = known
    dtype, shape, count = known
    if len(raw) - end != count * dtype.itemsize:
        return None
    arr = np.frombuffer(bytearray(raw[end:]), dtype=dtype, count=count)
    return arr if len(shape) == 1 else arr.reshape(shape)  # 1-D: already its shape (reshape costs a step's µs)


def npy(value: Any) -> Any:
    """An array from its ``.npy`` bytes in base64 (plain data only, never a pickle), or Bad."""
    import numpy as np

    raw = _b64(value, "an array")
    fast = _plain_npy(raw)
    if fast is not None:
        return fast
    try:
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
    except Exception as exc:  # numpy says why (object arrays need pickle: refused)
        raise Bad(f"an array that is not plain .npy data ({shown(str(exc))})") from None
    if arr.size > len(raw):  # only items of 0 bytes can outnumber the bytes sent
        raise Bad(f"an array of {arr.size:,} items of {arr.dtype.itemsize} bytes sent in {len(raw):,} bytes")
    _shape_ok(arr.shape, arr.size)
    _text_ok(arr)
    return arr


def _shape_ok(shape: tuple[int, ...], size: int) -> None:
    """Refuse a shape that describes far more nested lists than the array has items: what
    ``tolist`` (JSON, a served reply) makes of it is a Python list for each. An array of
    shape (5,000,000, 0) is 128 bytes of .npy and was 5 million lists, 700 MB, in a server.
    Trailing dimensions of 1 (an image's channel) stay well within the bound."""
    lists = nested_lists(shape)
    if lists > SHAPE_LISTS * size + SHAPE_SLACK:
        raise Bad(f"an array of shape {shown(shape)}: {lists:,} nested lists for {size:,} items "
                  "(its shape describes far more than its data); send it without its empty or repeated dimensions")


def nested_lists(shape: tuple[int, ...]) -> int:
    """The nested lists an array of ``shape`` is as a list of lists (``tolist``)."""
    return sum(math.prod(shape[:d]) for d in range(len(shape)))


def _text_ok(arr: Any) -> None:
    """Refuse an array holding text that is not valid Unicode (a lone surrogate, or a code
    point past U+10FFFF): it becomes a ``str`` the kernel can't send to the browser."""
    import numpy as np

    dt = arr.dtype
    for key in dt.fields or ():  # field names and titles are text too
        if not isinstance(key, str) or SURROGATE.search(key):
            raise Bad(f"an array whose field name {shown(key)} is not valid Unicode")
    if dt.names:
        for field in dt.names:
            _text_ok(arr[field])
    elif dt.kind == "U" and arr.size and dt.itemsize:
        codes = np.ascontiguousarray(arr).reshape(-1).view(dt.byteorder.replace("|", "=") + "u4")
        if ((codes >= 0xD800) & (codes <= 0xDFFF)).any() or (codes > 0x10FFFF).any():
            raise Bad("an array of text that is not valid Unicode (a lone surrogate or a code point past U+10FFFF)")


def _dtype(text: Any) -> Any:
    """A pandas dtype by name. Numpy dtypes whose items could be far larger than what was
    sent (fixed-width text and bytes, void, sub-arrays like ``10000000f8``) are refused:
    pandas never holds them as such (its text is object or string dtype)."""
    import pandas as pd

    name = string(text, "a pandas dtype", 64)
    if not DTYPE_RE.fullmatch(name):
        raise Bad(f"a pandas dtype {shown(name)} is not a dtype name")
    if not _zones_named(name):
        raise Bad(f"a pandas dtype {shown(name)} with a time zone that is not a tz database name")
    try:
        dtype = pd.api.types.pandas_dtype(name)
    except Exception:
        raise Bad(f"a pandas dtype {shown(name)} is not one pandas knows") from None
    if not _small_items(dtype):
        raise Bad(f"a pandas column of dtype {shown(name)} (pandas holds no such column)")
    return dtype


def _zones_named(name: str) -> bool:
    """Whether every time zone in a dtype's name is a tz database name or a fixed offset: pandas
    reads "dateutil/<path>" as a file the host would open, a path the machine named (in any
    spelling of a time zone pandas takes: "M8[ns, …]", inside "interval[…]")."""
    zones = [m[1].strip() for m in TZ_IN_DTYPE.finditer(name)]
    return "dateutil" not in name and all(z in _time_zones() or FIXED_OFFSET.fullmatch(z) for z in zones)


def _small_items(dtype: Any) -> bool:
    """Whether each item of ``dtype`` is at most 32 bytes, also inside the dtypes pandas wraps
    around a numpy one (``Sparse[10000000f8]``, ``interval[V1000000]`` held 80 MB per value)."""
    import numpy as np

    if isinstance(dtype, np.dtype):
        return not (dtype.kind in "SUV" or dtype.subdtype is not None or dtype.itemsize > 32)
    if type(dtype).__name__ == "ArrowDtype":  # fixed-size binaries and lists of any width: not taken
        return False
    inner = [getattr(dtype, attr, None) for attr in ("subtype", "numpy_dtype")]
    return all(_small_items(d) for d in inner if isinstance(d, np.dtype) and d != np.dtype(object))


@functools.cache
def _time_zones() -> frozenset[str]:
    import zoneinfo

    return frozenset(zoneinfo.available_timezones()) | {"UTC"}


def _column(enc: Any, depth: int, budget: Budget, rows: int | None = None) -> Any:
    """A pandas column: a list or a 1-D array of exactly ``rows`` items (when known), so
    nothing is broadcast or reindexed into more than was sent."""
    import numpy as np
    import pandas as pd

    enc = mapping(enc, "a pandas column", 4)
    budget.column()
    dtype = _dtype(enc.get("dtype"))
    data = data_value(enc.get("values"), depth + 1, budget)
    if not (isinstance(data, list) or (isinstance(data, np.ndarray) and data.ndim == 1)):
        raise Bad(f"a pandas column whose values are not a list or a 1-D array ({shown(type(data).__name__)})")
    if rows is not None and len(data) != rows:
        raise Bad(f"a pandas column of {len(data):,} values for an index of {rows:,} rows")
    if dtype == np.dtype(object):
        out = np.empty(len(data), dtype=object)
        for i, item in enumerate(data):  # one item per value, even a list (never a 2-D array)
            out[i] = item
        return out
    if isinstance(dtype, pd.CategoricalDtype) and isinstance(data, list):
        _spread(data, "category column")  # its categories are found by hashing every value
    try:
        return pd.array(data, dtype=dtype)
    except Exception as exc:
        raise Bad(f"a pandas column of dtype {shown(str(dtype))} can't be rebuilt ({shown(str(exc))})") from None


def _index(enc: Any, depth: int, budget: Budget) -> Any:
    import pandas as pd

    enc = mapping(enc, "a pandas index", 6)
    if enc.get("$") == "range":
        rows = range(integer(enc.get("start"), "start"), integer(enc.get("stop"), "stop"),
                     integer(enc.get("step"), "step") or 1)
        step = abs(rows.step)  # its length, counted without len() (which overflows past 2**63)
        budget.rows(max(0, ((rows.stop - rows.start) * (1 if rows.step > 0 else -1) + step - 1) // step))
        return pd.RangeIndex(rows.start, rows.stop, rows.step, name=data_value(enc.get("name"), depth + 1, budget))
    return pd.Index(_column(enc.get("values"), depth, budget), name=data_value(enc.get("name"), depth + 1, budget))


def _spread(keys: list[Any], what: str) -> None:
    """Refuse a set's items or a dict's keys built to share one hash: numbers and tuples of them
    hash alike in every process (only text is salted), and each shared hash costs every later
    insert a probe, so 40,000 multiples of 2**61 - 1 took 8.6 s (a million: an hour), in one C
    call on the loop that nothing interrupts."""
    if len(keys) <= COLLISIONS:
        return
    try:
        worst = max(collections.Counter(map(hash, keys)).values())
    except TypeError:
        raise Bad(f"a pulled {what} with an unhashable item") from None
    if worst > COLLISIONS:
        raise Bad(f"a pulled {what} of {len(keys):,} items, {worst:,} of them with one hash (made to cost the host "
                  "time quadratic in their number): refused")


def data_value(tree: Any, depth: int = 0, budget: Budget | None = None) -> Any:
    """Rebuild one value from its JSON tree (only the forms listed in the module doc)."""
    if depth > MAX_DEPTH:
        raise Bad("a pulled value nested too deeply")
    if budget is None:
        budget = Budget()
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, list):
        return [data_value(v, depth + 1, budget) for v in tree]
    if not isinstance(tree, dict):
        raise Bad(f"a pulled value of JSON type {type(tree).__name__}")
    tag = tree.get("$")
    v = tree.get("v")
    if tag == "dict":
        if not isinstance(v, list) or not all(isinstance(kv, list) and len(kv) == 2 for kv in v):
            raise Bad("a pulled dict that is not a list of key/value pairs")
        keys = [data_value(k, depth + 1, budget) for k, _ in v]
        _spread(keys, "dict")
        out = {}
        for key, (_, val) in zip(keys, v):
            try:
                out[key] = data_value(val, depth + 1, budget)
            except TypeError:
                raise Bad(f"a pulled dict with an unhashable key {shown(key)}") from None
        return out
    if tag in ("tuple", "set", "frozenset"):
        if not isinstance(v, list):
            raise Bad(f"a pulled {tag} that is not a list")
        items = [data_value(x, depth + 1, budget) for x in v]
        if tag != "tuple":
            _spread(items, tag)
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
        return npy(v)
    if tag == "npscalar":
        return npy(v)[()]
    if tag == "series":
        import pandas as pd

        tree = mapping(tree, "a pandas Series", 5)
        index = _index(tree.get("index"), depth, budget)
        return pd.Series(_column(tree.get("values"), depth, budget, len(index)), index=index,
                         name=data_value(tree.get("name"), depth + 1, budget), copy=False)
    if tag == "dataframe":
        import pandas as pd

        tree = mapping(tree, "a pandas DataFrame", 5)
        cols = data_value(tree.get("columns"), depth + 1, budget)
        data = tree.get("data")
        if not isinstance(cols, list) or not isinstance(data, list) or len(cols) != len(data):
            raise Bad("a pulled DataFrame whose columns and data don't match")
        index = _index(tree.get("index"), depth, budget)
        frame = pd.DataFrame({i: pd.Series(_column(c, depth, budget, len(index)), index=index, copy=False)
                              for i, c in enumerate(data)}, index=index)
        frame.columns = pd.Index(cols, tupleize_cols=False) if cols else pd.RangeIndex(0)
        return frame
    raise Bad(f"a pulled value of unknown form {shown(tag)}")


def pulled(name: str, enc: Any, trusted: bool, budget: Budget | None = None) -> Any:
    """One ``--pull`` value from its wire form: data, a refusal, or (trusted only) a pickle.
    ``budget`` is shared by the values of one reply."""
    from ..errors import SmolbenchError

    enc = mapping(enc, f"--pull {name}", 4)
    form = enc.get("format")
    if form == "data":
        return data_value(enc.get("data"), 0, budget)
    if form == "refused":
        kind = string(enc.get("type"), "a type name", 200)
        kind = re.sub(r"[^A-Za-z0-9_.<>\[\], ]", "?", kind)
        raise SmolbenchError(
            f"--pull {name}: {_a(kind)} is not plain data, so it is not unpickled on this host (that would run code "
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


def _a(word: str) -> str:
    """``word`` with its article: an object, a generator."""
    return ("an " if word[:1].lower() in "aeiou" else "a ") + word
