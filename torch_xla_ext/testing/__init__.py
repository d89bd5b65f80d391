"""Helpers for tests of code that must not move data between host and XLA device.

``measure_transfers()`` measures torch_xla's transfer metrics around exactly a
block (``with measure_transfers() as m: ...; assert not m.device_to_host``) and
``no_host_transfers()`` is the one-line assertion. The pytest plugin in
:mod:`torch_xla_ext.testing.plugin` (a ``pytest11`` entry point) adds the
``@pytest.mark.no_host_transfers`` marker and the ``no_host_transfers`` fixture;
``no_recompiles()`` (marker and fixture too) fails when XLA compiles.
"""

from __future__ import annotations

from ..recompile_guard import no_recompiles
from ..transfer_guard import TransferStats, measure_transfers, no_host_transfers

__all__ = ["TransferStats", "measure_transfers", "no_host_transfers", "no_recompiles"]
