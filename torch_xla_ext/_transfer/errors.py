"""The guard's exception, apart from the guard: its helper modules name it without importing the guard."""

from __future__ import annotations

__all__ = ["HostTransferError"]


class HostTransferError(RuntimeError):
    """A transfer between host and XLA device happened where a guard disallows it."""
