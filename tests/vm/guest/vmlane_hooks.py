"""Loaded by every python in the L1 guest (a .pth line): marks each smol ``Machine.create`` in
flight with a file in /run/vmlane, so the watchdog can tell a nested-stack stall inside
create from a hang anywhere else. Lane-only; never part of smolbench."""

import importlib.abc
import importlib.util
import os
import sys
import threading

_DIR = "/run/vmlane"
_count = iter(range(1 << 30))
_lock = threading.Lock()


def _wrap(module):
    machine = module.Machine
    create = machine.create.__func__

    def marked(cls, *args, **kwargs):
        with _lock:
            mark = os.path.join(_DIR, f"create-{os.getpid()}-{next(_count)}")
        try:
            open(mark, "w").close()
        except OSError:
            mark = None
        try:
            return create(cls, *args, **kwargs)
        finally:
            if mark:
                try:
                    os.unlink(mark)
                except OSError:
                    pass

    machine.create = classmethod(marked)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "smol.machine":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _wrap(module)

        spec.loader.exec_module = exec_module
        return spec


if os.path.isdir(_DIR):
    sys.meta_path.insert(0, _Finder())
