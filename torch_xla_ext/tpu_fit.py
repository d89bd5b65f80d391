"""``torch_xla_ext.tpu_fit``: the import path of :mod:`torch_xla_ext.tpu.fit` (the same module object)."""

import sys

from .tpu import fit as _fit

sys.modules[__name__] = _fit
