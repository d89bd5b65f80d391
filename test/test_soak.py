"""A short version of scripts/soak.py: a fully sharded, scanned tiny Llama trains with nothing drifting.

Steps after the second compile nothing (``no_recompiles`` inside the loop),
steps after the first move nothing device->host (``no_host_transfers``), and
after the first window neither the live XLA tensors nor host RSS grow.

It runs in a child process of its own: its RSS and live-tensor counts are
then its own, not those of whatever the suite ran before in the same worker,
and a crash is reported with the child's output instead of taking the
worker down (it once did, with nothing printed: pytest's capture holds a
test's stderr).
"""

from __future__ import annotations

import json
import sys
import textwrap

from child_process import SPMD_CHILD, TEST_DIR, run_surviving

sys.path.insert(0, str(TEST_DIR.parent / "scripts"))

from soak import Window, flatness  # noqa: E402

_CHILD = SPMD_CHILD + textwrap.dedent(f'''
    import dataclasses, json
    sys.path.insert(0, {str(TEST_DIR.parent / "scripts")!r})
    from soak import soak

    print(json.dumps([dataclasses.asdict(w) for w in soak(steps=12, every=4)]))
''')


def test_a_short_soak_stays_flat(tmp_path):
    windows = [Window(**w) for w in json.loads(run_surviving(tmp_path, _CHILD).splitlines()[-1])]
    flat = flatness(windows)
    assert [w.last_step for w in windows] == [4, 8, 12]
    assert windows[0].compiles >= 1  # the warm-up window compiled the step
    assert flat["compiles_after_first_window"] == 0, windows
    assert flat["d2h_bytes"] == 0, windows
    assert flat["live_tensor_growth"] == 0, windows
    # RSS: allocator noise only (measured 0.0 MiB over 15 steps); a leak of one step's tensors would be more.
    assert flat["rss_growth_mib"] < 64, windows
