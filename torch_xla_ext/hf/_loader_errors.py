"""A collator's error on the loader's thread, brought back to the training thread.

On XLA accelerate runs Trainer's train loader inside torch_xla's
prefetching ``MpDeviceLoader``. A collator that raises kills that thread;
the training loop then sees the data end and returns after fewer steps
(after none, for an error in the first batch), the error printed at best.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["CollatorErrors"]


class CollatorErrors:
    """``collator`` called on the loader's thread, its first error kept for the training thread.

    ``SPMDTrainer`` raises the kept error at its next training step and at
    the end of ``train()``.
    """

    def __init__(self, collator: Callable[[list], Any] | None) -> None:
        self.collator = collator
        self.error: BaseException | None = None

    def __call__(self, rows: list) -> Any:
        try:
            return self.collator(rows)
        except BaseException as error:
            if self.error is None:
                self.error = error
            raise

    def raise_if_any(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error
