"""The machinery behind :mod:`torch_xla_ext.transfer_guard`, one idea a module.

* :mod:`.metrics` reads torch_xla's transfer metrics and their timestamped
  samples (process-wide evidence of what moved; reading it moves nothing).
* :mod:`.explicit` says which torch calls move an XLA tensor's data between
  host and device, and intercepts them in one thread before anything moves.
* :mod:`.calls` wraps torch's explicit device->host entry points for every
  thread and records who read what, and when.
* :mod:`.attribution` matches a block's metric samples against other
  threads' recorded calls.
* :mod:`.tracebacks` keeps the guard's own frames out of the tracebacks of
  the ``HostTransferError`` it raises (for pytest and its plugin).

The guard itself (frames, nesting, the verdict) is
:mod:`torch_xla_ext.transfer_guard`.
"""
