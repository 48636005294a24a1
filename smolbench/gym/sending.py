"""A callable env as it is sent into the machine: cloudpickled, the user's own modules by value.

cloudpickle sends a class or function it can import by reference (its module's name), so
``make(myenvs.Grid)`` with ``myenvs.py`` beside the script failed in the machine: ``No
module named 'myenvs'``. A module that is a plain file of the user's (not installed: outside
site-packages and the standard library, not smolbench's) goes by value instead.
"""

from __future__ import annotations

import contextlib
import functools
import os
import site
import sys
import sysconfig
from collections.abc import Iterator
from types import ModuleType
from typing import Any

MISSING_HINT = ("the machine can't import it: define the env in the session's machine (s.run(code), or a %%smol "
                "cell) and make it by name, or install the module there (the Smolfile)")


def dumps(env: Any) -> bytes:
    """``env`` cloudpickled, the user's own modules it comes from by value (undone after)."""
    import cloudpickle

    with _by_value(cloudpickle, _own_modules(env)):
        return bytes(cloudpickle.dumps(env))


@contextlib.contextmanager
def _by_value(cloudpickle: Any, modules: list[ModuleType]) -> Iterator[None]:
    registered = {m for m in modules if m.__name__ not in cloudpickle.list_registry_pickle_by_value()}
    for m in registered:
        cloudpickle.register_pickle_by_value(m)
    try:
        yield
    finally:
        for m in registered:
            with contextlib.suppress(ValueError):
                cloudpickle.unregister_pickle_by_value(m)


def _own_modules(env: Any) -> list[ModuleType]:
    """The modules ``env`` (a class, a function, a callable object; under functools.partial)
    comes from that are plain files of the user's."""
    fn = env
    while isinstance(fn, functools.partial):
        fn = fn.func
    names = {getattr(fn, "__module__", None), type(fn).__module__}
    return [m for name in names if isinstance(name, str) and (m := sys.modules.get(name)) is not None and _users(m)]


def _users(module: ModuleType) -> bool:
    name = module.__name__
    if name == "__main__" or name.split(".")[0] in ("smolbench", "smolbench_guest") or name in sys.stdlib_module_names:
        return False
    path = getattr(module, "__file__", None)
    if not isinstance(path, str) or not path.endswith(".py"):
        return False
    real = os.path.realpath(path)
    parts = real.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    roots = [sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    roots += [*getattr(site, "getsitepackages", list)(), site.getusersitepackages()]
    return not any(isinstance(r, str) and real.startswith(os.path.realpath(r) + os.sep) for r in roots)
