"""smolbench's jupyter_server extension: the REST API behind the JupyterLab sidebar.

Enabled by ``etc/jupyter/jupyter_server_config.d/smolbench.json`` (installed with the
package). It adds handlers to the running server: no new port, the server's own auth.
"""

from __future__ import annotations

from typing import Any


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "smolbench.server"}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    from .handlers import setup_handlers

    km = serverapp.kernel_manager
    runtime = getattr(km, "connection_dir", "") or serverapp.runtime_dir
    setup_handlers(serverapp.web_app, serverapp.root_dir, runtime)
    serverapp.log.info("smolbench: sidebar API at %ssmolbench/api/ (kernels' registry in %s)", serverapp.base_url, runtime)
