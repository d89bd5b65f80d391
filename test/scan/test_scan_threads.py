"""scan on one thread while other threads of the process go on: nothing of theirs is changed or blamed.

Each case runs in a child process (a thread that left torch_xla's execution
switch off, or executed placeholders, would take the whole suite down with
it) and repeats its interleavings for many rounds.
"""

from __future__ import annotations

import textwrap

from child_process import SPMD_CHILD, run_surviving

#: A loader thread running while the main thread scans: ``alongside(loader, step, steps)`` returns how
#: many of the main thread's steps were refused.
_ALONGSIDE = SPMD_CHILD + textwrap.dedent('''
    import threading
    import torch_xla_ext as txe

    def alongside(loader, step, steps):
        done = threading.Event()
        thread = threading.Thread(target=loader, args=(done,))
        thread.start()
        refused = 0
        try:
            for i in range(steps):
                try:
                    step(i)
                except txe.ScanUnsupportedError as error:
                    refused += 1
                    print("refused:", str(error)[:200])
        finally:
            done.set()
            thread.join()
        torch_xla.sync()
        return refused
''')

_LOADER_DRAWS = _ALONGSIDE + textwrap.dedent('''
    import random

    layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(4)]).to(dev)
    x = torch.randn(8, 16).to(dev)
    w = torch.randn(16).to(dev)
    drawn = {"torch": [], "random": [], "numpy": []}

    def loader(done):  # shuffling and augmenting on the host, as a data loader thread does
        while not done.is_set():
            drawn["torch"].append(torch.randn(3))
            drawn["random"].append(random.random())
            drawn["numpy"].append(np.random.rand(2))

    def step(i):
        txe.scan(lambda c, xi: (torch.tanh(c * w + xi), None), torch.zeros(16, device=dev),
                 torch.ones(3, 16, device=dev) * i)
        txe.scan_layers(layers, x).sum().backward()

    torch.manual_seed(11); random.seed(12); np.random.seed(13)
    refused = alongside(loader, step, 12)
    # The same generators seeded alike, drawn from alone: the loader's draws must be exactly these.
    n = {k: len(v) for k, v in drawn.items()}
    torch.manual_seed(11); random.seed(12); np.random.seed(13)
    same = (all(torch.equal(a, torch.randn(3)) for a in drawn["torch"])
            and all(a == random.random() for a in drawn["random"])
            and all(np.array_equal(a, np.random.rand(2)) for a in drawn["numpy"]))
    print("refused", refused, "draws", min(n.values()) > 0, "unchanged", same,
          "switch", torch_xla._XLAC._get_allow_execution())
''')


def test_a_loader_thread_drawing_host_random_numbers_is_neither_rewound_nor_blamed(tmp_path):
    # Before, every trace snapshotted and restored the process's host generators: the loader's
    # draws repeated (about half of them), and most scans were refused for draws fn never made.
    out = run_surviving(tmp_path, _LOADER_DRAWS)
    assert out.splitlines()[-1] == "refused 0 draws True unchanged True switch True", out


_LOADER_UPLOADS = _ALONGSIDE + textwrap.dedent('''
    w = torch.randn(16).to(dev)
    uploaded, errors, results = [], [], []

    def loader(done):  # host batches copied to the device, as torch_xla's loader threads do
        gen = torch.Generator().manual_seed(5)
        try:
            while not done.is_set():
                uploaded.append(torch.randn(64, 16, generator=gen).to(dev) * 2)
        except BaseException as error:  # reported below
            errors.append(repr(error)[:300])

    def step(i):
        results.append(txe.scan(lambda c, xi: (c * w + xi, None), torch.zeros(16, device=dev),
                                torch.ones(3, 16, device=dev) * i)[0])

    refused = alongside(loader, step, 12)
    expected = []
    for step in range(12):
        c = torch.zeros(16)
        for _ in range(3):
            c = c * w.cpu() + step
        expected.append(c)
    exact = all(torch.allclose(r.cpu(), e, rtol=1e-5, atol=1e-5) for r, e in zip(results, expected))
    gen = torch.Generator().manual_seed(5)
    copies = all(torch.equal(u.cpu(), torch.randn(64, 16, generator=gen) * 2) for u in uploaded[:50])
    print("refused", refused, "errors", errors, "values", exact, "copies", len(uploaded) > 0 and copies)
''')


def test_a_loader_thread_copying_to_the_device_neither_fails_nor_makes_scans_refuse(tmp_path):
    out = run_surviving(tmp_path, _LOADER_UPLOADS)
    assert out.splitlines()[-1] == "refused 0 errors [] values True copies True", out


_SHARED_LAYERS = SPMD_CHILD + textwrap.dedent('''
    import threading
    import torch_xla_ext as txe

    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(4)]).to(dev)
    inputs = [torch.randn(2, 8).to(dev) * (i + 1) for i in range(4)]

    def loop(x):
        for layer in layers:
            x = layer(x)
        return x

    expected = [loop(x).detach().cpu() for x in inputs]
    bad = 0
    for round in range(int(sys.argv[1])):
        results, errors = {}, []

        def run(i):
            try:
                for _ in range(3):
                    out = txe.scan_layers(layers, inputs[i])
                    out.sum().backward()  # the backward loop is traced lazily, on autograd's thread
                results[i] = out.detach()
            except BaseException as error:  # reported below
                errors.append(repr(error)[:300])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        switch = torch_xla._XLAC._get_allow_execution()
        ok = not errors and switch and all(
            torch.allclose(results[i].cpu(), expected[i], rtol=1e-5, atol=1e-5) for i in range(4))
        if not ok:
            bad += 1
            print("round", round, "errors", errors, "switch", switch)
            torch_xla._XLAC._set_allow_execution(True)
    print("bad rounds", bad)
''')


def test_scan_layers_on_shared_layers_from_several_threads_computes_the_loop(tmp_path):
    # Each call swaps layers[0]'s parameters while it traces (functional_call) and runs AOTAutograd,
    # which is not thread-safe: calls from several threads run one at a time. The backward's lazy
    # trace runs on autograd's device thread, outside that order; it shares torch_xla's execution
    # switch with the forward traces by reference count. Before, each trace saved and restored the
    # switch on its own, and about 1 run in 3 of the old in-process test left it off for good.
    out = run_surviving(tmp_path, _SHARED_LAYERS, "8")
    assert out.splitlines()[-1] == "bad rounds 0", out
