"""tpu._widen: a 1-D mesh's shardings re-annotated for more devices, and everything else refused."""

from __future__ import annotations

import pytest

from torch_xla_ext.tpu._widen import widen_shardings

EIGHT = ",".join(str(d) for d in range(8))


def test_one_dimension_over_all_devices_is_widened_in_both_spellings():
    text = (f"%p = f32[64,32]{{1,0}} parameter(0), sharding={{devices=[8,1]{EIGHT}}}\n"
            f"%q = f32[4,64] parameter(1), sharding={{devices=[1,8]<=[8]}}\n"
            f"%w = (f32[], f32[64]) while(%t), sharding={{{{replicated}}, {{devices=[8]{EIGHT}}}}}")
    assert widen_shardings(text, 8, 32) == (
        "%p = f32[64,32]{1,0} parameter(0), sharding={devices=[32,1]<=[32]}\n"
        "%q = f32[4,64] parameter(1), sharding={devices=[1,32]<=[32]}\n"
        "%w = (f32[], f32[64]) while(%t), sharding={{replicated}, {devices=[32]<=[32]}}")


@pytest.mark.parametrize("sharding, why", [
    ("{devices=[2,4]<=[8]}", "does not split one dimension"),
    ("{devices=[8,1]7,6,5,4,3,2,1,0}", "does not split one dimension"),
    ("{devices=[4,1]0,1,2,3}", "does not split one dimension"),
    ("{devices=[4,1,2]<=[8] last_tile_dim_replicate}", "'last_tile_dim'"),
    ("{maximal device=0}", "'maximal'"),
    ("{manual}", "'manual'"),
])
def test_anything_but_a_1d_mesh_is_refused(sharding, why):
    with pytest.raises(ValueError, match=why):
        widen_shardings(f"%p = f32[64,32] parameter(0), sharding={sharding}", 8, 32)


def test_a_collective_written_into_the_program_is_refused():
    with pytest.raises(ValueError, match="'replica_groups'"):
        widen_shardings("%a = f32[8] all-reduce(%p), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add", 8, 32)


def test_words_in_the_metadata_are_not_taken_for_shardings():
    text = ('%p = f32[64] parameter(0), sharding={devices=[8]<=[8]}, '
            'metadata={op_name="manual_maximal_layer" source_file="/replica_groups/x.py"}')
    assert widen_shardings(text, 8, 16).startswith("%p = f32[64] parameter(0), sharding={devices=[16]<=[16]}")
