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
    keep_status_for_cells(km, serverapp.web_app.settings)


def keep_status_for_cells(km: Any, settings: dict[str, Any]) -> None:
    """Widget clicks answered on a kernel subshell end with an "idle" status for their comm
    message (and the subshell's creation with one for its control request), and JupyterLab /
    Notebook 7 would then show the kernel Idle while a cell still runs. They ignore status
    messages caused by the message types in this list (the page config's
    ``untracked_message_types``), so add those. (Widget messages then no longer count as
    activity for idle-kernel culling, which is off by default.)"""
    extra = ["comm_msg", "create_subshell_request", "delete_subshell_request", "list_subshell_request"]
    types = list(getattr(km, "untracked_message_types", None) or [])
    km.untracked_message_types = [*types, *(t for t in extra if t not in types)]
    page = settings.get("page_config_data")  # JupyterLab copied the list before we loaded
    if isinstance(page, dict) and isinstance(page.get("untracked_message_types"), list):
        have = page["untracked_message_types"]
        page["untracked_message_types"] = [*have, *(t for t in extra if t not in have)]
