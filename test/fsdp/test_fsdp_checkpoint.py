"""Checkpoints of a fully sharded model and its AdamW state: what gathers and what does not.

``torch.distributed.checkpoint`` (DCP) with torch_xla's ``SPMDSavePlanner`` and
``SPMDLoadPlanner`` writes and reads each device's shard of every sharded
tensor: a save and a load gather nothing (``ReplicateShardedData`` stays put),
move each value's bytes across once, and the loaded parameters and optimizer
state keep fully_shard's sharding and train on bit-exactly. ``torch.save`` of
the same state dict gathers every sharded tensor to one device first.

DCP runs here in one process without a process group (it says so in a warning
and plans alone); ``CheckpointManager`` needs one, and the ``process_group``
fixture makes a single-process gloo group. Before DCP reads a tensor, the step
that wrote it must have finished (``settle``): DCP reads the device buffers
directly, and a buffer still being computed fails with ``Trying to access XLA
data for tensor with ID ... while an async operation is in flight``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch_xla.experimental.distributed_checkpoint import (CheckpointManager, SPMDLoadPlanner, SPMDSavePlanner,
                                                           prime_optimizer)

from fsdp_helpers import seeded  # noqa: F401  (a fixture: pytest finds it by name)
from fsdp_helpers import EXACT, FSDP8, FSDP8_1D, batch, loss_fn, shard_decoder, spec, tiny_decoder

pytestmark = [
    # DCP's and the SPMD planners' own chatter, not this library's.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized"),
    pytest.mark.filterwarnings("ignore:The function definition for SavePlanner.set_up_planner"),
    pytest.mark.filterwarnings("ignore:TypedStorage is deprecated"),
    pytest.mark.filterwarnings("ignore:Using a non-tuple sequence for multidimensional indexing"),
]

LR = 1e-2


@dataclasses.dataclass
class Moved:
    """What crossed between host and devices, and how many sharded tensors were gathered, inside a block."""

    gathers: int = 0  # torch_xla's ReplicateShardedData counter
    d2h_bytes: int = 0  # InboundData
    h2d_bytes: int = 0  # OutboundData


def _read() -> Moved:
    def accumulated(name: str) -> int:
        data = met.metric_data(name)
        return 0 if data is None else int(data[1])

    return Moved(gathers=int(met.counter_value("ReplicateShardedData") or 0),  # absent: never bumped
                 d2h_bytes=accumulated("InboundData"), h2d_bytes=accumulated("OutboundData"))


class measured:
    """``with measured() as m: ...`` -> ``m`` holds the deltas over exactly the block."""

    def __enter__(self) -> Moved:
        self._start, self._delta = _read(), Moved()
        return self._delta

    def __exit__(self, *exc) -> None:
        end = _read()
        for f in dataclasses.fields(Moved):
            setattr(self._delta, f.name, getattr(end, f.name) - getattr(self._start, f.name))


def settle() -> None:
    """Run what is pending and wait for the devices: DCP reads device buffers, which must exist by then."""
    torch_xla.sync()
    xm.wait_device_ops()


def train_step(model, opt, tx, gx) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model, tx, gx)
    loss.backward()
    opt.step()
    torch_xla.sync()
    return loss


def trained(device, mesh):
    """The tiny decoder, fully sharded per layer and at the root, after one AdamW step (so Adam's state exists)."""
    torch.manual_seed(0)
    model = shard_decoder(tiny_decoder(use_scan=False), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    _, (tx, gx) = batch(device, mesh)
    train_step(model, opt, tx, gx)
    settle()
    return model, opt, (tx, gx)


def fresh(mesh):
    """The same architecture with other weights (seed 1), fully sharded, and an AdamW without state."""
    torch.manual_seed(1)
    model = shard_decoder(tiny_decoder(use_scan=False), mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)


def host_copy(model, opt) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Parameters and optimizer state on the host, keyed by parameter name (this gathers: call it after measuring).

    Copies, also of Adam's step count, which already lives on the host and which the next step increments in place.
    """
    params = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    state = {n: {k: v.to("cpu", copy=True) for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    return params, state


def shardings(model, opt) -> dict[str, str]:
    out = {}
    for n, p in model.named_parameters():
        out[n] = spec(p)
        for k, v in opt.state.get(p, {}).items():
            out[f"{n}/{k}"] = spec(v) if v.device.type == "xla" else "host"
    return out


def sharded_bytes(state) -> int:
    """Bytes of every sharded XLA tensor in a nested state dict (one value under two keys counts twice)."""
    if isinstance(state, dict):
        return sum(sharded_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(sharded_bytes(v) for v in state)
    if isinstance(state, torch.Tensor) and state.device.type == "xla" and spec(state) not in ("", "{replicated}"):
        return state.numel() * state.element_size()
    return 0


def expected_shardings(model) -> dict[str, str]:
    """fully_shard's sharding of every parameter and of Adam's moments; Adam's step count stays on the host."""
    out = {}
    for n, p in model.named_parameters():
        out[n] = FSDP8 if p.dim() == 2 else FSDP8_1D
        out[f"{n}/exp_avg"] = out[f"{n}/exp_avg_sq"] = out[n]
        out[f"{n}/step"] = "host"
    return out


# The two ways to hand DCP a model's and an optimizer's state:
#   "get_state_dict": torch.distributed.checkpoint.state_dict.get_state_dict(model, opt), whose optimizer
#       state is keyed by parameter name; on a fresh optimizer it creates Adam's state with a zero-gradient,
#       zero-lr step; set_state_dict(model, opt, ...) puts the loaded values back.
#   "state_dict": model.state_dict() and opt.state_dict() (keyed by parameter index); a fresh optimizer's
#       state is created with torch_xla's prime_optimizer; load_state_dict puts the loaded values back.
def state_of(api: str, model, opt, *, prime: bool = False) -> dict:
    if api == "get_state_dict":
        model_state, optim_state = get_state_dict(model, opt)
    else:
        if prime:
            prime_optimizer(opt)
        model_state, optim_state = model.state_dict(), opt.state_dict()
    return {"model": model_state, "optim": optim_state}


def put_back(api: str, model, opt, state: dict) -> None:
    if api == "get_state_dict":
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])


def assert_same(model, opt, params, state) -> None:
    now_params, now_state = host_copy(model, opt)
    assert list(now_params) == list(params) and list(now_state) == list(state)
    for n in params:
        torch.testing.assert_close(now_params[n], params[n], **EXACT, msg=n)
        assert list(now_state[n]) == list(state[n]), n
        for k in state[n]:
            torch.testing.assert_close(now_state[n][k], state[n][k], **EXACT, msg=f"{n}/{k}")


@pytest.fixture
def process_group(tmp_path):
    """A single-process gloo group (file:// rendezvous in tmp_path, no port), destroyed afterwards."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("api", ["get_state_dict", "state_dict"])
def test_dcp_with_the_spmd_planners_round_trips_model_and_optimizer_without_a_gather(device, mesh, tmp_path, api):
    model, opt, (tx, gx) = trained(device, mesh)
    saved_shardings = shardings(model, opt)
    assert saved_shardings == expected_shardings(model)
    state = state_of(api, model, opt)
    settle()
    nbytes = sharded_bytes(state)
    # Every parameter, head.weight (tied to embed.weight) once more under its own key, Adam's two moments each.
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert nbytes == 3 * param_bytes + model.head.weight.numel() * 4 == 61184
    with measured() as saving:
        dcp.save(state, checkpoint_id=tmp_path / "ckpt", planner=SPMDSavePlanner())
    assert saving.gathers == 0, saving
    assert saving.d2h_bytes == nbytes, saving  # each device's shard read once; no device reads another's
    params, optim = host_copy(model, opt)

    target_model, target_opt = fresh(mesh)
    target = state_of(api, target_model, target_opt, prime=True)
    settle()
    assert shardings(target_model, target_opt) == saved_shardings  # created sharded, so loaded in place, shard by shard
    before, _ = host_copy(target_model, target_opt)
    assert all(not torch.equal(before[n], params[n]) for n in params)
    with measured() as loading:
        dcp.load(target, checkpoint_id=tmp_path / "ckpt", planner=SPMDLoadPlanner())
    assert loading.gathers == 0, loading
    # The planner reads the target's shards to the host, fills them from the files and uploads each to its device.
    assert loading.d2h_bytes == loading.h2d_bytes == nbytes, loading
    assert shardings(target_model, target_opt) == saved_shardings
    with measured() as putting:
        put_back(api, target_model, target_opt, target)
        settle()
    assert putting.gathers == 0 and putting.d2h_bytes == 0 and putting.h2d_bytes == 0, putting
    assert shardings(target_model, target_opt) == saved_shardings
    assert target_model.embed.weight is target_model.head.weight
    assert_same(target_model, target_opt, params, optim)

    loss = train_step(model, opt, tx, gx)
    target_loss = train_step(target_model, target_opt, tx, gx)
    torch.testing.assert_close(target_loss.cpu(), loss.cpu(), **EXACT)
    assert_same(target_model, target_opt, *host_copy(model, opt))


def test_dcp_loads_in_place_into_the_state_dicts_tensors(device, mesh, tmp_path):
    """dcp.load writes into the tensors of the state dict it is given: the parameters and Adam's state
    themselves, with no load_state_dict after it."""
    model, opt, _ = trained(device, mesh)
    state = state_of("get_state_dict", model, opt)
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", planner=SPMDSavePlanner())
    params, optim = host_copy(model, opt)
    target_model, target_opt = fresh(mesh)
    target = state_of("get_state_dict", target_model, target_opt)
    settle()
    dcp.load(target, checkpoint_id=tmp_path / "ckpt", planner=SPMDLoadPlanner())
    assert_same(target_model, target_opt, params, optim)
    assert shardings(target_model, target_opt) == expected_shardings(target_model)


def test_torch_save_of_the_state_dict_gathers_every_sharded_tensor(device, mesh, tmp_path):
    model, opt, _ = trained(device, mesh)
    model_state, optim_state = model.state_dict(), opt.state_dict()
    # 26 keys for 25 parameters: head.weight is embed.weight (tied), detached again under its own key.
    assert len(model_state) == 26 and len(list(model.parameters())) == 25
    assert all(spec(v) in (FSDP8, FSDP8_1D) for v in model_state.values())
    moments = [v for s in optim_state["state"].values() for k, v in s.items() if k != "step"]
    assert len(moments) == 50 and all(spec(v) in (FSDP8, FSDP8_1D) for v in moments)
    assert all(s["step"].device.type == "cpu" for s in optim_state["state"].values())
    with measured() as one:
        model.embed.weight.cpu()
    assert one.gathers == 1, one  # a sharded tensor's .cpu() gathers it to one device first
    with measured() as saving_model:
        torch.save(model_state, tmp_path / "model.pt")
    assert saving_model.gathers == len(model_state) == 26, saving_model  # one gather per key, the tied one twice
    with measured() as saving_optim:
        torch.save(optim_state, tmp_path / "optim.pt")
    assert saving_optim.gathers == len(moments) == 50, saving_optim  # exp_avg and exp_avg_sq per parameter
    params, _ = host_copy(model, opt)
    loaded = torch.load(tmp_path / "model.pt", map_location="cpu")
    for n, p in params.items():
        torch.testing.assert_close(loaded[n], p, **EXACT, msg=n)


def test_checkpoint_manager_saves_and_restores_without_a_gather(device, mesh, tmp_path, process_group):
    model, opt, (tx, gx) = trained(device, mesh)
    manager = CheckpointManager(str(tmp_path / "ckpts"), save_interval=2, chkpt_on_preemption=False)
    with measured() as skipped:
        assert not manager.save(1, {"model": model.state_dict(), "optim": opt.state_dict()})  # 1 % 2 != 0
    assert skipped == Moved()
    with measured() as saving:
        assert manager.save(2, {"model": model.state_dict(), "optim": opt.state_dict()})
    assert saving.gathers == 0, saving
    at_2 = host_copy(model, opt)
    train_step(model, opt, tx, gx)
    with measured() as saving_async:  # shards copied to the host here, written by a background thread
        assert manager.save_async(4, {"model": model.state_dict(), "optim": opt.state_dict()})
        manager.join()
    assert saving_async.gathers == 0, saving_async
    at_4 = host_copy(model, opt)
    assert manager.all_steps() == [2, 4]
    for step, (params, optim) in [(2, at_2), (4, at_4)]:
        target_model, target_opt = fresh(mesh)
        prime_optimizer(target_opt)
        target = {"model": target_model.state_dict(), "optim": target_opt.state_dict()}
        with measured() as restoring:
            manager.restore(step, target)
        assert restoring.gathers == 0, (step, restoring)
        target_model.load_state_dict(target["model"])
        target_opt.load_state_dict(target["optim"])
        assert_same(target_model, target_opt, params, optim)
        assert shardings(target_model, target_opt) == expected_shardings(target_model)


def test_checkpoint_manager_needs_a_process_group(tmp_path):
    assert not dist.is_initialized()
    with pytest.raises(AssertionError, match="A process group is required"):
        CheckpointManager(str(tmp_path / "ckpts"), save_interval=1, chkpt_on_preemption=False)


def test_checkpoint_manager_cannot_watch_for_preemption_on_cpu(tmp_path, process_group):
    # chkpt_on_preemption=True (the default) starts torch_xla's coordinator at the master's IP, which
    # torch_xla finds only on TPU and Neuron; the error comes before anything is started.
    with pytest.raises(RuntimeError, match="IP discovery not supported for device: CPU"):
        CheckpointManager(str(tmp_path / "ckpts"), save_interval=1)
