"""The mark_sharding redirect scan's autograd trace uses: scoped to the thread that opened it."""

from __future__ import annotations

import threading

import torch
import torch_xla.distributed.spmd as xs

from torch_xla_ext._xla import redirected_mark_sharding


def test_a_redirect_in_one_thread_leaves_other_threads_on_torch_xla(device, mesh):
    opened, done = threading.Event(), threading.Event()
    seen = []

    def handler(original, t, mesh, spec, *args, **kwargs):
        seen.append(threading.current_thread().name)
        return original(t, mesh, spec, *args, **kwargs)

    def holder():
        with redirected_mark_sharding(handler):
            opened.set()
            done.wait(60)
            xs.mark_sharding(torch.zeros(8, device=device), mesh, ("fsdp",))  # redirected: this thread's

    thread = threading.Thread(target=holder, name="tracer")
    thread.start()
    assert opened.wait(60)
    try:
        annotated = xs.mark_sharding(torch.ones(8, device=device), mesh, ("fsdp",))  # torch_xla's own
    finally:
        done.set()
        thread.join(60)
    assert seen == ["tracer"]
    assert "devices=[8]" in torch_xla_sharding_spec(annotated.global_tensor)


def torch_xla_sharding_spec(t: torch.Tensor) -> str:  # noqa: D103
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(t)
