"""stack_layers keeps PyTorch's per-parameter contract, or refuses the operation where it is written.

Each per-layer thing a user does to a stacked layer (freeze it, optimize it, clip or log its gradients, hook,
replace, wrap, convert or copy it, decay rules, checkpoints) either gives the unstacked model's numbers or raises
StackedLayerError / ScanInputError at that line, with nothing changed.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

import torch_xla_ext as txe
from scan_blocks import make_blocks
from scan_reference import assert_close_derived

L, D, H, B = 4, 16, 32, 8


class Net(torch.nn.Module):
    """An embedding-like input projection registered before the stack, the stack, a head after it."""

    def __init__(self, layers: torch.nn.ModuleList) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(D, D)
        self.layers = layers
        self.head = torch.nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, scanned: bool = True) -> torch.Tensor:
        h = self.inp(x)
        if scanned:
            h = txe.scan_layers(self.layers, h)
        else:
            for layer in self.layers:
                h = layer(h)
        return self.head(h)


def _nets(device: torch.device) -> tuple[Net, Net]:
    """(unstacked, stacked) copies of one Net on the device."""
    torch.manual_seed(0)
    plain = Net(make_blocks(L, D, H)).to(device)
    stacked = copy.deepcopy(plain)
    txe.stack_layers(stacked.layers)
    return plain, stacked


def _still_whole(net: Net) -> None:
    """Nothing changed: every stacked parameter still requires grad and has no gradient."""
    for name, p in net.layers.named_parameters():
        assert p.requires_grad and p.grad is None, name


def test_per_layer_parameter_lists_are_refused_where_they_are_written(device):
    _, net = _nets(device)
    layer = net.layers[1]
    with pytest.raises(txe.StackedLayerError, match=r"layers\[1\]\.named_parameters\(\)/parameters\(\): this "
                                                    r"layer is stored stacked"):
        layer.parameters()  # refused at the call, not at the first iteration
    with pytest.raises(txe.StackedLayerError, match="stored stacked"):
        layer.requires_grad_(False)  # freezing the first layers
    with pytest.raises(txe.StackedLayerError, match="stored stacked"):
        torch.optim.SGD([{"params": net.inp.parameters()}, {"params": layer.parameters(), "lr": 0.01}], lr=0.1)
    with pytest.raises(txe.StackedLayerError, match="stored stacked"):
        torch.nn.utils.clip_grad_norm_(layer.parameters(), 1.0)
    with pytest.raises(txe.StackedLayerError, match="stored stacked"):
        layer.zero_grad()
    with pytest.raises(txe.StackedLayerError, match=r"layers\[1\]\.up\.named_parameters"):
        dict(layer.up.named_parameters(recurse=False))  # a no-decay rule by module type walks these
    with pytest.raises(txe.StackedLayerError, match=r"to\(\)/half\(\)/float\(\)/cpu\(\)"):
        layer.to(torch.bfloat16)
    _still_whole(net)
    # The same operations on the model or the ModuleList work on the stacked parameters.
    assert len(list(net.layers.parameters())) == 6
    net.layers.requires_grad_(False)
    assert not any(p.requires_grad for p in net.layers.parameters())
    net.layers.requires_grad_(True)
    net.layers.half()
    assert net.layers.get_parameter("up/weight").dtype == torch.float16
    assert net.layers[2].up.weight.dtype == torch.float16
    net.float()
    assert net.layers[2].up.weight.dtype == torch.float32


def test_a_rows_gradient_is_the_unstacked_layers_and_writes_reach_the_stacked_gradient(device):
    plain, net = _nets(device)
    x = torch.randn(B, D).to(device)
    for scanned in (True, False):
        for model in (plain, net):
            model.zero_grad()
            model(x, scanned=scanned).square().sum().backward()
        for i in range(L):
            for name in ("up.weight", "down.bias", "norm.weight"):
                got = net.layers[i].get_submodule(name.rpartition(".")[0])
                got = getattr(got, name.rpartition(".")[2]).grad
                want = plain.layers[i].get_parameter(name).grad
                assert_close_derived(got, want, L * (D + H) * B, msg=f"layers[{i}].{name} scanned={scanned}")
    # Logging a per-layer gradient norm reads the row; zeroing it writes into the stacked gradient.
    norm = net.layers[2].up.weight.grad.norm()
    torch.testing.assert_close(norm.cpu(), plain.layers[2].up.weight.grad.norm().cpu(), rtol=1e-5, atol=1e-6)
    net.layers[2].up.weight.grad.zero_()
    stacked_grad = net.layers.get_parameter("up/weight").grad.cpu()
    assert torch.count_nonzero(stacked_grad[2]) == 0 and torch.count_nonzero(stacked_grad[1]) > 0
    with pytest.raises(txe.StackedLayerError, match=r"layers\[2\]\.up\.weight\.grad = \.\.\."):
        net.layers[2].up.weight.grad = None


def test_row_operations_that_need_a_parameter_of_its_own_are_refused(device):
    _, net = _nets(device)
    w = net.layers[3].down.weight
    before = net.layers.get_parameter("down/weight").cpu()
    for what, act in (("data = ...", lambda: setattr(w, "data", torch.zeros_like(w))),
                      ("requires_grad_()", lambda: w.requires_grad_(False)),
                      ("requires_grad = ...", lambda: setattr(w, "requires_grad", False)),
                      ("register_hook()", lambda: w.register_hook(lambda g: g * 0)),
                      ("register_post_accumulate_grad_hook()",
                       lambda: w.register_post_accumulate_grad_hook(lambda p: None)),
                      ("retain_grad()", lambda: w.retain_grad())):
        with pytest.raises(txe.StackedLayerError, match=rf"layers\[3\]\.down\.weight\.{what.replace('(', '.').replace(')', '.')}"
                                                        rf".*row 3 of the stacked parameter 'down/weight'"):
            act()
    holder = net.layers[3].down
    with pytest.raises(txe.StackedLayerError, match="Write into its row"):
        holder.weight = torch.nn.Parameter(torch.zeros(D, H, device=device))
    with pytest.raises(txe.StackedLayerError, match="Write into its row"):
        holder.register_parameter("weight", torch.nn.Parameter(torch.zeros(D, H, device=device)))
    with pytest.raises(txe.StackedLayerError, match="Write into its row"):
        del holder.weight
    torch.testing.assert_close(net.layers.get_parameter("down/weight").cpu(), before)
    _still_whole(net)


def test_in_place_writes_into_a_row_reach_the_stacked_parameter_as_on_the_unstacked_model(device):
    plain, net = _nets(device)
    for model in (plain, net):
        layer = model.layers[1]
        torch.nn.init.constant_(layer.up.weight, 0.25)   # nn.init, under no_grad
        layer.down.bias.data.fill_(-1.0)                 # through .data
        with torch.no_grad():
            layer.norm.weight.mul_(3.0)
    x = torch.randn(B, D).to(device)
    torch.testing.assert_close(net(x).cpu(), plain(x).cpu(), rtol=1e-5, atol=1e-5)
    assert torch.equal(net.layers.get_parameter("up/weight")[1].cpu(), torch.full((H, D), 0.25))


def test_replacing_or_wrapping_a_submodule_that_holds_rows_is_refused(device):
    _, net = _nets(device)

    class Wrapper(torch.nn.Module):  # a LoRA-style wrapper around the base layer
        def __init__(self, base: torch.nn.Module) -> None:
            super().__init__()
            self.base_layer = base
            self.lora = torch.nn.Linear(D, H, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base_layer(x) + self.lora(x)

    layer = net.layers[0]
    with pytest.raises(txe.StackedLayerError, match=r"layers\[0\]\.up = \.\.\. / del.*Replace or wrap submodules "
                                                    r"before stack_layers"):
        layer.up = Wrapper(layer.up)
    with pytest.raises(txe.StackedLayerError, match="Replace or wrap"):
        layer.add_module("up", torch.nn.Linear(D, H).to(device))
    with pytest.raises(txe.StackedLayerError, match="Replace or wrap"):
        del layer.up
    assert type(layer.up).__name__ == "Linear"
    layer.up = layer.up  # assigning the same module is no change
    layer.extra = torch.nn.Identity()  # a new submodule holding no rows is the layer's own


def test_copying_one_stacked_layer_is_refused_and_copying_the_model_works(device):
    plain, net = _nets(device)
    with pytest.raises(txe.StackedLayerError, match=r"layers\[2\]\.copy\.deepcopy"):
        copy.deepcopy(net.layers[2])
    twin = copy.deepcopy(net)
    x = torch.randn(B, D).to(device)
    torch.testing.assert_close(twin(x).cpu(), plain(x).cpu(), rtol=1e-5, atol=1e-5)
    with pytest.raises(txe.StackedLayerError):
        twin.layers[0].parameters()  # the copy's layers keep the contract
    assert twin.layers.get_parameter("up/weight") is not net.layers.get_parameter("up/weight")


def test_torch_save_of_a_stacked_model_loads_back_stacked(device):
    plain, net = _nets(device)
    buffer = io.BytesIO()
    torch.save(net, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(B, D).to(device)
    torch.testing.assert_close(loaded.to(device)(x).cpu(), plain(x).cpu(), rtol=1e-5, atol=1e-5)
    assert list(loaded.state_dict()) == list(plain.state_dict())
    with pytest.raises(txe.StackedLayerError):
        loaded.layers[1].parameters()


def test_an_optimizer_that_holds_per_layer_parameters_is_refused(device):
    torch.manual_seed(0)
    early = Net(make_blocks(L, D, H)).to(device)
    opt = torch.optim.SGD(early.parameters(), lr=0.1)
    with pytest.raises(txe.ScanInputError, match=r"an optimizer \(SGD\) already holds layers\[0\]\.up\.weight.*"
                                                 r"Create the optimizer after stack_layers"):
        txe.stack_layers(early.layers)
    assert isinstance(early.layers[0].up.weight, torch.nn.Parameter)  # nothing changed
    del opt
    kept = list(early.layers[0].up.parameters())  # per-layer parameters kept by hand before stacking
    txe.stack_layers(early.layers)
    late = torch.optim.SGD(kept, lr=0.1)
    with pytest.raises(txe.StackedLayerError, match=r"SGD\.step: it holds layers\[0\]\.up\.weight \(now a row of "
                                                    r"the stacked parameter 'up/weight'\)"):
        late.step()


def test_a_parameter_tied_to_a_module_outside_the_stack_is_refused(device):
    torch.manual_seed(0)
    net = Net(make_blocks(L, D, H)).to(device)
    side = torch.nn.Module()  # a module outside the list, e.g. a shared norm
    side.register_parameter("tied", net.layers[2].norm.weight)
    with pytest.raises(txe.ScanInputError, match=r"layers\[2\]\.norm\.weight is also the parameter 'tied' of a "
                                                 r"Module outside these layers \(tied\)"):
        txe.stack_layers(net.layers)
    assert isinstance(net.layers[2].norm.weight, torch.nn.Parameter)


def _groups(model: torch.nn.Module, rule: str) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if rule == "dim":  # the usual rule, blind to stacking
            low = p.dim() < 2
        else:  # the rule on the per-layer shape: a stacked parameter's dim 0 indexes the layers
            low = (p.dim() - 1 if name.startswith("layers.") and "/" in name else p.dim()) < 2
        (no_decay if low else decay).append(p)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def test_weight_decay_rules_blind_to_stacking_are_refused_at_the_step_and_per_layer_ones_train_alike(device):
    plain, net = _nets(device)
    x = torch.randn(B, D).to(device)
    blind = torch.optim.AdamW(_groups(net, "dim"), lr=1e-2)
    net(x).sum().backward()
    with pytest.raises(txe.StackedLayerError, match=r"AdamW\.step: the stacked parameter of the layers' 'up\.bias' "
                                                    r"\(per layer \(32,\)\) is in a group with weight_decay=0\.1"):
        blind.step()
    net.zero_grad()
    losses = []
    for model, rule in ((plain, "dim"), (net, "per-layer")):
        opt = torch.optim.AdamW(_groups(model, rule), lr=1e-2)
        run = []
        for _ in range(3):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.detach())
        losses.append(torch.stack(run).cpu())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    # One group that decays everything is no rule to miss: it trains as the unstacked model does.
    one = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    net(x).sum().backward()
    one.step()


def test_a_strict_load_reports_missing_keys_of_modules_beside_a_stack_of_linears(device):
    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = torch.nn.Linear(D, D)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(3))

    model = Two().to(device)
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    txe.stack_layers(model.layers)  # its stacked keys are 'weight' and 'bias', as first's last names are
    del state["first.weight"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "first.weight"'):
        model.load_state_dict(state)
    assert model.load_state_dict(state, strict=False).missing_keys == ["first.weight"]


def test_a_sharded_checkpoint_loads_across_layouts_for_the_model_and_refuses_the_optimizer(device, tmp_path):
    from torch_xla_ext.distributed.checkpoint import load_sharded, save_sharded

    plain, net = _nets(device)
    x = torch.randn(B, D).to(device)
    opts = {}
    for label, model in (("plain", plain), ("stacked", net)):
        opts[label] = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(x).square().mean().backward()
        opts[label].step()
        opts[label].zero_grad()
        save_sharded(tmp_path / label, model, opts[label])
    for source, target, opt in (("stacked", plain, opts["plain"]), ("plain", net, opts["stacked"])):
        with pytest.raises(ValueError, match=rf"whose layers were {'stored stacked' if source == 'stacked' else 'not'}"
                                             rf".*Load it into a model stacked as the saved one was"):
            load_sharded(tmp_path / source, target, opt)
    # The model's own state is keyed per layer in both layouts: it loads across them.
    fresh_plain, fresh_stacked = _nets(device)
    load_sharded(tmp_path / "stacked", fresh_plain)
    load_sharded(tmp_path / "plain", fresh_stacked)
    for model in (fresh_plain, fresh_stacked):
        torch.testing.assert_close(model(x).cpu(), plain(x).cpu(), rtol=1e-5, atol=1e-5)
