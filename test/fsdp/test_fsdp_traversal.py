"""Traversal order, shared-parameter LCA and dynamo marks of composable FSDP.

Pure CPU: these helpers only look at module and parameter objects.  Random
hierarchies (shared submodules, cycles, ``None`` slots, shared parameters) are
checked against torch's own ``named_modules()`` and a brute-force LCA built
from ancestor sets.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_xla_ext.distributed._dynamo import annotate_modules_for_dynamo
from torch_xla_ext.distributed._lca import SharedParamInfo, get_shared_param_info_to_lca, param_owners
from torch_xla_ext.distributed._traversal import lr_dfs, lr_dfs_modules, module_tree

DEEP = 3000
# Derandomized: the same 150 examples on every run (hypothesis derives them from
# each test's source), so a pass or a failure reproduces; no deadline, since CI
# machines vary in speed.
_SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None)


@pytest.fixture(autouse=True)
def seeded():
    """Parameter initializations (nn.Linear, nn.Embedding) draw from a seeded generator."""
    torch.manual_seed(0)


# --------------------------------------------------------------------------- helpers


@st.composite
def graphs(draw, max_nodes: int = 10, pool: int = 5):
    """A random module graph: a spanning tree from node 0 plus extra edges.

    Extra edges may create shared submodules and cycles; child order is
    shuffled so first-path-wins is exercised.  Target -1 is a ``None`` slot.
    Each node also registers a few parameters drawn from a shared pool (-1:
    a ``None`` parameter slot), possibly the same one twice.
    """
    n = draw(st.integers(1, max_nodes))
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        children[draw(st.integers(0, i - 1))].append(i)
    extra = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(-1, n - 1)), max_size=2 * n))
    for src, dst in extra:
        children[src].append(dst)
    children = [draw(st.permutations(c)) for c in children]
    params = [draw(st.lists(st.integers(-1, pool - 1), max_size=3)) for _ in range(n)]
    return n, children, params, pool


def build(spec) -> tuple[list[nn.Module], list[nn.Parameter]]:
    n, children, params, pool = spec
    mods = [nn.Module() for _ in range(n)]
    plist = [nn.Parameter(torch.zeros(1)) for _ in range(pool)]
    for i, cs in enumerate(children):
        for k, c in enumerate(cs):
            mods[i].add_module(f"c{k}_{c}".replace("-", "n"), None if c < 0 else mods[c])
        for k, p in enumerate(params[i]):
            mods[i].register_parameter(f"p{k}", None if p < 0 else plist[p])
    return mods, plist


class _CutEdges:
    """Temporarily replace every edge into a module of ``cut`` by ``None``."""

    def __init__(self, mods: list[nn.Module], cut: set[int]) -> None:
        self.mods, self.cut, self.saved = mods, cut, []

    def __enter__(self):
        for m in self.mods:
            for name, child in list(m._modules.items()):
                if child is not None and id(child) in self.cut:
                    self.saved.append((m, name, child))
                    m._modules[name] = None
        return self

    def __exit__(self, *exc):
        for m, name, child in self.saved:
            m._modules[name] = child


def reference_named(root: nn.Module, mods: list[nn.Module], skipped: set[int]) -> list[tuple[str, nn.Module]]:
    """What named_modules() lists once the skipped modules are cut out."""
    if id(root) in skipped:
        return []
    with _CutEdges(mods, skipped):
        return list(root.named_modules())


def ancestors(name: str) -> list[str]:
    """FQNs of the DFS-tree ancestors of ``name``, root first, ``name`` last."""
    parts = name.split(".") if name else []
    return [""] + [".".join(parts[:k]) for k in range(1, len(parts) + 1)]


def brute_lca(names: list[str]) -> str:
    common = set(ancestors(names[0]))
    for nm in names[1:]:
        common &= set(ancestors(nm))
    return max(common, key=lambda s: len(ancestors(s)))


def brute_shared(named, ignored_ids):
    by_name = dict(named)
    first: dict[int, tuple[str, nn.Module, str]] = {}
    expected: dict[SharedParamInfo, nn.Module] = {}
    users: dict[int, list[str]] = {}
    objs: dict[int, nn.Parameter] = {}
    for name, m in named:
        for pname, p in m._parameters.items():
            if p is None or id(p) in ignored_ids:
                continue
            users.setdefault(id(p), []).append(name)
            objs[id(p)] = p
            if id(p) not in first:
                first[id(p)] = (name, m, pname)
                continue
            fname, fm, fpname = first[id(p)]
            expected[SharedParamInfo(pname, m, name, fpname, fm, fname)] = by_name[brute_lca([name, fname])]
    owners = {objs[k]: by_name[brute_lca(v)] for k, v in users.items()}
    return expected, owners


def assert_same_map(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k] is want[k], k


def chain(depth: int) -> list[nn.Module]:
    mods = [nn.Module() for _ in range(depth)]
    for parent, child in zip(mods, mods[1:]):
        parent.add_module("c", child)
    return mods


# --------------------------------------------------------------------------- traversal


def _example():
    mod = nn.Module()
    mod.submod1 = nn.Module()
    mod.submod2 = nn.Module()
    mod.submod2.subsubmod = nn.Module()
    return mod


def test_left_to_right_order():
    mod = _example()
    got = lr_dfs(mod)
    assert [n for n, _ in got] == ["", "submod1", "submod2", "submod2.subsubmod"]
    want = [mod, mod.submod1, mod.submod2, mod.submod2.subsubmod]
    assert all(a is b for (_, a), b in zip(got, want)) and len(got) == 4
    assert all(a is b for a, b in zip(lr_dfs_modules(mod), want))


def test_first_path_wins_for_shared_module():
    root = nn.Module()
    shared = nn.Linear(2, 2)
    root.a = nn.Sequential(nn.ReLU(), shared)
    root.b = shared
    names = {id(m): n for n, m in lr_dfs(root)}
    assert names[id(shared)] == "a.1"
    assert len(lr_dfs(root)) == 4


@_SETTINGS
@given(graphs())
def test_matches_named_modules(spec):
    mods, _ = build(spec)
    got = lr_dfs(mods[0])
    want = list(mods[0].named_modules())
    assert [n for n, _ in got] == [n for n, _ in want]
    assert all(a is b for (_, a), (_, b) in zip(got, want))


@_SETTINGS
@given(graphs(), st.data())
def test_skip_matches_named_modules_with_subtrees_cut(spec, data):
    mods, _ = build(spec)
    skipped = {id(m) for m in data.draw(st.lists(st.sampled_from(mods), max_size=3))}
    calls: Counter[int] = Counter()

    def skip(m: nn.Module) -> bool:
        calls[id(m)] += 1
        return id(m) in skipped

    got = lr_dfs(mods[0], skip=skip)
    want = reference_named(mods[0], mods, skipped)
    assert [n for n, _ in got] == [n for n, _ in want]
    assert all(a is b for (_, a), (_, b) in zip(got, want))
    assert all(c == 1 for c in calls.values())


def test_skip_prunes_subtree_but_keeps_other_paths():
    root = nn.Module()
    shared = nn.Linear(1, 1)
    root.rep = nn.Sequential(nn.Linear(1, 1), shared)  # pruned subtree
    root.other = nn.Sequential(shared)  # second path to one of its modules
    got = lr_dfs(root, skip=lambda m: m is root.rep)
    assert [n for n, _ in got] == ["", "other", "other.0"]
    assert got[2][1] is shared
    assert lr_dfs(root, skip=lambda m: m is root) == []


def test_bad_arguments():
    with pytest.raises(TypeError, match="nn.Module"):
        lr_dfs("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        lr_dfs(nn.Module(), skip=3)  # type: ignore[arg-type]


def test_deep_chain_traversal_does_not_recurse():
    mods = chain(DEEP)
    with pytest.raises(RecursionError):  # the chain really is too deep for recursion
        list(mods[0].named_modules())
    got = lr_dfs(mods[0])
    assert len(got) == DEEP
    assert all(a is b for (_, a), b in zip(got, mods))
    assert got[-1][0] == ".".join(["c"] * (DEEP - 1))
    mid = DEEP // 2
    assert [m for m in lr_dfs_modules(mods[0], skip=lambda m: m is mods[mid])] == mods[:mid]
    tree = module_tree(mods[0])
    assert tree.fqn(DEEP - 1) == got[-1][0] and tree.parents[DEEP - 1] == DEEP - 2


# --------------------------------------------------------------------------- LCA


@_SETTINGS
@given(graphs(), st.data())
def test_lca_matches_brute_force(spec, data):
    mods, plist = build(spec)
    ignored = set(data.draw(st.lists(st.sampled_from(plist), max_size=2)))
    named = list(mods[0].named_modules())
    want_shared, want_owners = brute_shared(named, {id(p) for p in ignored})
    assert_same_map(get_shared_param_info_to_lca(mods[0], ignored), want_shared)
    assert_same_map(param_owners(mods[0], ignored), want_owners)


@_SETTINGS
@given(graphs(), st.data())
def test_lca_with_skip_matches_brute_force(spec, data):
    mods, _ = build(spec)
    skipped = {id(m) for m in data.draw(st.lists(st.sampled_from(mods[1:] or mods), max_size=2))}
    named = reference_named(mods[0], mods, skipped)
    want_shared, want_owners = brute_shared(named, set())
    skip = lambda m: id(m) in skipped  # noqa: E731
    assert_same_map(get_shared_param_info_to_lca(mods[0], skip=skip), want_shared)
    assert_same_map(param_owners(mods[0], skip=skip), want_owners)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(8, 8)


def _tied_layers() -> nn.ModuleList:
    layers = nn.ModuleList(_Layer() for _ in range(4))
    layers[0].embed = nn.Embedding(16, 8)
    layers[3].head = nn.Linear(8, 16, bias=False)
    layers[3].head.weight = layers[0].embed.weight
    return layers


def test_tied_embedding_lca_is_the_root():
    layers = _tied_layers()
    embed, head = layers[0].embed, layers[3].head
    got = get_shared_param_info_to_lca(layers)
    info = SharedParamInfo("weight", head, "3.head", "weight", embed, "0.embed")
    assert list(got) == [info] and got[info] is layers
    owners = param_owners(layers)
    assert owners[embed.weight] is layers
    assert owners[layers[1].mlp.weight] is layers[1].mlp  # unshared: its own module
    assert len(owners) == 1 + 4 * 2  # tied weight + (weight, bias) of 4 mlps


def test_tied_embedding_under_a_model_goes_to_the_module_list():
    model = nn.Module()
    model.layers = _tied_layers()
    model.norm = nn.LayerNorm(8)
    got = get_shared_param_info_to_lca(model)
    assert len(got) == 1
    (info, lca), = got.items()
    assert (info.module_name, info.prim_module_name) == ("layers.3.head", "layers.0.embed")
    assert lca is model.layers  # the lowest module holding both, not the model
    # Once the list is pruned, no user remains.
    assert param_owners(model, skip=lambda m: m is model.layers) == {
        model.norm.weight: model.norm,
        model.norm.bias: model.norm,
    }


def test_same_module_and_ancestor_sharing():
    root = nn.Module()
    root.a = nn.Linear(2, 2)
    root.a.inner = nn.Module()
    w = root.a.weight
    root.a.alias = w  # twice in the same module
    root.a.inner.w = w  # in a descendant
    got = get_shared_param_info_to_lca(root)
    assert [(i.module_name, i.param_name, i.prim_param_name) for i in got] == [
        ("a", "alias", "weight"),
        ("a.inner", "w", "weight"),
    ]
    assert all(v is root.a for v in got.values())
    assert param_owners(root)[w] is root.a


def test_ignored_params_are_excluded():
    layers = _tied_layers()
    tied = layers[0].embed.weight
    assert get_shared_param_info_to_lca(layers, {tied}) == {}
    owners = param_owners(layers, {tied})
    assert tied not in owners and len(owners) == 8
    with pytest.raises(TypeError, match="collection"):
        get_shared_param_info_to_lca(layers, tied)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="nn.Module"):
        param_owners([layers])  # type: ignore[arg-type]


def test_shared_param_info_is_hashable_by_module_identity():
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    i1 = SharedParamInfo("w", a, "a", "w", b, "b")
    i2 = SharedParamInfo("w", a, "a", "w", b, "b")
    i3 = SharedParamInfo("w", nn.Linear(1, 1), "a", "w", b, "b")
    assert len({i1, i2, i3}) == 2


def test_deep_chain_lca_does_not_recurse():
    mods = chain(DEEP)
    leaf, mid = mods[-1], mods[10]
    mods[5].side = nn.Module()
    p = nn.Parameter(torch.zeros(1))
    leaf.p = p
    mid.q = p
    mods[5].side.r = p
    got = get_shared_param_info_to_lca(mods[0])
    assert len(got) == 2
    infos = list(got)
    assert infos[0].prim_module is mid and infos[0].module is leaf
    assert infos[0].module_name == ".".join(["c"] * (DEEP - 1))
    assert infos[0].prim_module_name == ".".join(["c"] * 10)
    assert got[infos[0]] is mid
    # side is visited after the whole chain below mods[5].
    assert infos[1].module is mods[5].side and got[infos[1]] is mods[5]
    assert param_owners(mods[0])[p] is mods[5]


# --------------------------------------------------------------------------- dynamo


def _model() -> nn.Module:
    shared = nn.Linear(2, 2)
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), shared), nn.ReLU(), shared, nn.Sequential(nn.Tanh()))
    return model


def _marked(model: nn.Module) -> list[nn.Module]:
    keys = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")
    return [m for m in model.modules() if any(k in m.__dict__ for k in keys)]


@pytest.mark.parametrize("use_orig_params", [True, False])
def test_annotate_marks_exactly_the_non_ignored(use_orig_params):
    model = _model()
    ignored = [model[0], model[3][0]]
    annotate_modules_for_dynamo(model, iter(ignored), use_orig_params)  # a one-shot iterable is fine
    mods = list(model.modules())
    assert len(mods) == 7
    for m in mods:
        if any(m is i for i in ignored):
            assert m not in _marked(model)
        else:
            assert m._is_fsdp_managed_module is True
            assert m._fsdp_use_orig_params is use_orig_params
    assert len(_marked(model)) == 5
    assert model[0][0]._is_fsdp_managed_module  # children of an ignored module are not exempt


class _AlwaysEqual(nn.Module):
    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return 0


def test_annotate_ignores_by_identity():
    model = nn.Sequential(_AlwaysEqual(), _AlwaysEqual())
    annotate_modules_for_dynamo(model, {model[0]}, True)
    assert model[1]._is_fsdp_managed_module is True
    assert "_is_fsdp_managed_module" not in model[0].__dict__


def test_annotate_deep_chain():
    mods = chain(DEEP)
    annotate_modules_for_dynamo(mods[0], [mods[-1]], True)
    assert all(m.__dict__.get("_is_fsdp_managed_module") is True for m in mods[:-1])
    assert "_is_fsdp_managed_module" not in mods[-1].__dict__


def _bad_then_good(model):
    yield model[0]
    yield torch.zeros(1)


@pytest.mark.parametrize(
    "make_args",
    [
        lambda m: ("model", [], True),
        lambda m: (m, [torch.zeros(1)], True),
        lambda m: (m, _bad_then_good(m), True),
        lambda m: (m, m[0], True),  # a single module, not a collection
        lambda m: (m, 5, True),
        lambda m: (m, [], 1),
        lambda m: (m, [], None),
    ],
)
def test_annotate_rejects_bad_input_before_changing_anything(make_args):
    model = _model()
    with pytest.raises(TypeError):
        annotate_modules_for_dynamo(*make_args(model))
    assert _marked(model) == []
