"""Hooks the agent runs when a cell's code first imports a module (matplotlib.pyplot,
IPython's display): the agent never imports those itself, so it learns of them here.

Stdlib only, Python 3.8+: runs inside the machine (see ``agent.py``). One finder at the
front of ``sys.meta_path`` answers only for the names it has hooks for: ``before`` hooks run
as the import starts (its parent package is imported already), the others once the module's
code ran, before the importer gets it. A hook that fails is ignored: the import goes on.
"""

import sys

_hooks = {}  # type: dict  # module name -> [(hook, before)]


def after(name, hook, before=False):
    """Run ``hook(module)`` once ``name`` is imported (``before``: ``hook(None)`` as it starts)."""
    _hooks.setdefault(name, []).append((hook, before))
    if _Finder not in sys.meta_path:
        sys.meta_path.insert(0, _Finder)


def _run(hook, module):
    try:
        hook(module)
    except Exception:
        pass


class _Finder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        hooks = _hooks.get(name)
        if not hooks:
            return None
        for hook, before in hooks:
            if before:
                _run(hook, None)
        later = [hook for hook, before in hooks if not before]
        if not later:
            return None
        spec = _others(name, path, target)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, later)
        return spec


def _others(name, path, target):
    for finder in sys.meta_path:
        if finder is _Finder:
            continue
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        spec = find(name, path, target)
        if spec is not None:
            return spec
    return None


class _Loader:
    """The module's own loader, and the hooks once its code ran."""

    def __init__(self, loader, hooks):
        self._loader, self._hooks = loader, hooks

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for hook in self._hooks:
            _run(hook, module)

    def __getattr__(self, name):  # get_data, get_resource_reader, is_package...
        return getattr(self._loader, name)
