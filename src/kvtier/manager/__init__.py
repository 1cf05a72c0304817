"""The scheduler-side orchestrator: :class:`TieringManager` and the pieces it is built from.

Importers use this package (``from kvtier.manager import TieringManager``); its
modules are the manager's rooms (see :mod:`kvtier.manager.core`).
"""

from kvtier.manager.core import TieringManager

__all__ = ["TieringManager"]
