"""Notebook views of a Workbench: the live fork tree, the checkpoint panel, reward plots.

They observe the Workbench and call its methods; they never call a backend themselves.
``smolbench.widgets.plots`` (plotly) is imported only when a plot is asked for.
"""

from __future__ import annotations

from typing import Any

from .checkpoints import CheckpointPanel, checkpoint_panel, close_panel, follow_panels
from .tree import TreeWidget, close_tree, tree_widget

__all__ = [
    "CheckpointPanel",
    "TreeWidget",
    "checkpoint_panel",
    "close_views",
    "follow_views",
    "tree_widget",
]


def close_views(workbench: Any) -> None:
    """Detach every view of ``workbench`` (its machines are gone); they keep their last state."""
    close_tree(workbench)
    close_panel(workbench)


def follow_views(workbench: Any) -> None:
    """A new Workbench is up: views that follow the kernel (checkpoint panels) bind to it."""
    follow_panels(workbench)
