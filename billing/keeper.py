"""What the query side needs of the ledger: its transactions, and the heartbeat its hours use.

Allocation, closing months, the exports and the reads of the registry build their SQL as pure
functions and run it through the ledger (``billing.ledger.Ledger``), the one holder of the
connection and of the writer's lock. They ask for it by this shape rather than by the class, so
the ledger can hand a caller of its own (archive, federation) to them without the two modules
importing each other, and a test can run them on anything with these three transactions.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import duckdb

__all__ = ["Keeper", "LedgerError", "LedgerUnavailableError"]


class LedgerError(Exception):
    """The ledger file cannot be used (newer schema, unreadable, or a refused operation).

    Declared with the ledger's shape so that the query side can refuse an operation (closing
    a closed month) without importing the ledger; ``billing.ledger`` exports it too.
    """


class LedgerUnavailableError(Exception):
    """A transaction could not be committed (the disk is full, the file unwritable): nothing of
    it is kept, and the same batch sent again later is taken (503 ``ledger_unavailable``)."""


class Keeper(Protocol):
    """The ledger's transactions (``billing.ledger.Ledger`` has them)."""

    @property
    def heartbeat_seconds(self) -> float:
        """Where a lifetime that never stopped is ended (``billing.lifetimes``)."""
        ...

    def reader(self) -> AbstractContextManager[duckdb.DuckDBPyConnection]:
        """A cursor for reading beside the writer."""
        ...

    def snapshot(self) -> AbstractContextManager[duckdb.DuckDBPyConnection]:
        """A cursor whose every query reads one committed state."""
        ...

    def writing(self) -> AbstractContextManager[duckdb.DuckDBPyConnection]:
        """A cursor in a transaction of its own, under the writer's lock."""
        ...
