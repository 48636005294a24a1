"""Hatch build hook: build the JupyterLab extension when its prebuilt output is missing.

The output (``smolbench/labextension/``) is committed, so ``pip install`` never needs Node;
this hook only runs npm when someone deleted it (``npm run clean``) or on a fresh
checkout of a tree that doesn't ship it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class LabextensionHook(BuildHookInterface):  # type: ignore[misc]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        root = Path(self.root)
        out = root / "smolbench" / "labextension" / "package.json"
        src = root / "labextension"
        if out.exists() or not (src / "package.json").exists():
            return
        npm = shutil.which("npm")
        if npm is None:
            raise RuntimeError("the JupyterLab extension is not built and npm is missing: "
                               "install Node.js and npm (apt-get install nodejs npm), or use a wheel")
        subprocess.run([npm, "ci" if (src / "package-lock.json").exists() else "install",
                        "--no-audit", "--no-fund"], cwd=src, check=True)
        subprocess.run([npm, "run", "build:prod"], cwd=src, check=True)
