"""Binding graphs with collectives to each rank's own process groups (issue 27), without a job: the group roles,
the code rewrites both ways, what stays keyed per rank, and how explain names the difference.
The 4-rank jobs are in test_collectives.py."""

from __future__ import annotations

import pytest

from recipecache.runs.explain import named_differences
from recipecache.torch_integration.precompiled.compiled_function import grouped_key
from recipecache.torch_integration.rank_binding import (PLACEHOLDER_PREFIX, Groups, RankBound, canonical_code,
                                                        groups_named, local_code, local_groups, rebind_graph, role_of)

#: what torch writes into the FX key and the generated code differs between releases: checked on each
pytestmark = pytest.mark.internals

#: the groups of ranks 0 and 3 of a dp=2 x tp=2 mesh, as torch names them (world '0', dp '1'/'2', tp '3'/'4')
RANK0 = Groups({"0": role_of([0, 1, 2, 3]), "1": role_of([0, 2]), "3": role_of([0, 1])})
RANK3 = Groups({"0": role_of([0, 1, 2, 3]), "2": role_of([1, 3]), "4": role_of([2, 3])})

CODE = """def forward(self, x):
    tp = torch.ops._c10d_functional.all_reduce.default(x, 'sum', '3')
    dp = torch.ops._c10d_functional.all_reduce.default(x, 'avg', '1')
    os.environ['TORCHINDUCTOR_COMPILE_THREADS'] = '1'
    return (tp, dp)
"""


def test_groups_of_one_mesh_dimension_share_a_role() -> None:
    assert role_of([0, 1]) == role_of([2, 3]) == "2@0,1"
    assert role_of([0, 2]) == role_of([1, 3]) == "2@0,2"
    assert role_of([0, 1]) != role_of([0, 2])


def test_code_is_stored_with_roles_and_loaded_with_this_ranks_groups() -> None:
    names: dict[str, str] = {}
    stored = canonical_code(CODE, RANK0, names)
    assert names == {"3": PLACEHOLDER_PREFIX + "2@0,1", "1": PLACEHOLDER_PREFIX + "2@0,2"}
    assert "'3'" not in stored and "'sum'" in stored
    assert "= '1'" in stored  # an environment value that looks like a group name, on no collective's line
    assert stored == canonical_code(CODE.replace("'3'", "'4'").replace("'1')", "'2')"), RANK3)  # one key
    loaded = local_code(stored, RANK3)
    assert "all_reduce.default(x, 'sum', '4')" in loaded  # rank 3's tp group, not rank 0's
    assert "all_reduce.default(x, 'avg', '2')" in loaded  # its dp group, not its tp group of the same size
    assert local_code(stored, RANK0) == CODE


def test_precompiled_code_serves_only_ranks_of_the_groups_it_names() -> None:
    """The precompiled tier reads the groups a whole compiled function names from its pickle (text among bytes); a
    rank serves it only where those are its own groups, and else looks under the key naming its own."""
    pickled = b"\x80\x05\x95" + CODE.encode() + b"\x94\x8c\x01" + b"'1' and '4' off a collective line"
    named = groups_named(pickled.decode("latin-1"), RANK0)
    assert named == {"3": "2@0,1", "1": "2@0,2"}
    assert local_groups(named, RANK0) is None, "rank 0's own groups: it runs this code"
    theirs = local_groups(named, RANK3)
    assert theirs == {"2@0,1": "4", "2@0,2": "2"}
    assert grouped_key("k", theirs) == grouped_key("k", {"2@0,2": "2", "2@0,1": "4"}) != grouped_key("k", {
        "2@0,1": "3", "2@0,2": "1"})
    with pytest.raises(RankBound):  # a rank with no group of the role the code names runs nothing of it
        local_groups({"5": "3@0,1,2"}, RANK0)


def test_a_group_that_cannot_be_bound_one_to_one_stays_keyed_per_rank() -> None:
    twins = Groups({"0": role_of([0, 1]), "5": role_of([0, 1])})  # e.g. a new_group() of the tp ranks
    with pytest.raises(RankBound, match="same ranks pattern"):
        canonical_code("y = torch.ops._c10d_functional.all_reduce.default(x, 'sum', '5')\n", twins)
    with pytest.raises(RankBound, match="2 process groups of role 2@0,1"):
        local_code(f"y = torch.ops._c10d_functional.all_reduce.default(x, 'sum', '{PLACEHOLDER_PREFIX}2@0,1')", twins)
    with pytest.raises(RankBound, match="0 process groups"):
        local_code(f"y = f(x, '{PLACEHOLDER_PREFIX}8@0,1,2,3,4,5,6,7')", RANK0)
    with pytest.raises(RankBound, match="other than a c10d collective"):
        canonical_code("y = torch.ops.symm_mem.fused_all_gather_matmul(x, w, 0, '3')\n", RANK0)
    # not strict (a report's identity): never raises
    assert PLACEHOLDER_PREFIX in canonical_code("y = torch.ops._c10d_functional.all_reduce.default(x, 'sum', '5')\n",
                                                twins, strict=False)


class Graph:
    """The fields of inductor's ``CompiledFxGraph`` that binding reads and writes."""

    def __init__(self, source: str) -> None:
        self.source_code = source
        self.runnable_graph_str = source
        self.inductor_post_grad_graph_str = source
        self.cache_key = "original"


def test_a_rebound_graph_gets_its_own_module_name() -> None:
    """Ranks of two tp groups sharing one node's cache dir load the module of their own rebinding."""
    stored = canonical_code(CODE, RANK0)
    mine, theirs = Graph(stored), Graph(stored)
    rebind_graph(mine, RANK0)
    rebind_graph(theirs, RANK3)
    assert mine.source_code == CODE and "'4'" in theirs.source_code and "'4'" in theirs.runnable_graph_str
    assert len({mine.cache_key, theirs.cache_key, "original"}) == 3


def test_explain_names_the_group_the_mesh_and_the_device_ordinal() -> None:
    named = named_differences([
        ("process_group[0]", ("'3' (2@0,1)", "'4' (2@0,1)")),
        ("device_mesh[0]", ("rank 0, coordinate (0,), groups '3'", "rank 1, coordinate (1,), groups '3'")),
        ("example_inputs[0]", ("TensorMetadata(device=device(type='cuda', index=0))",
                               "TensorMetadata(device=device(type='cuda', index=1))")),
    ])
    assert named[:4] == ["process group '3' vs '4'", "device mesh coordinate (0,) vs (1,)", "rank 0 vs 1",
                         "device ordinal"]
    assert named_differences([("cpp_runtime_thread_count", ("1", "2"))]) == []


def test_a_graph_with_collectives_is_recorded_under_its_identity_across_ranks(tmp_path) -> None:
    """The key records of two ranks' per-rank keys of one graph share the identity the integration computed
    (their torch components name each rank's own groups), so the report's duplicate list catches them."""
    from recipecache.keylog import KeyLog
    from recipecache.runs.keyinfo import load_keys

    for rank, group in ((0, "'3'"), (2, "'4'")):
        log = KeyLog(tmp_path / "events" / "keys", rank=rank)
        code = f"GraphModule() all_reduce.default(x, 'sum', {group})"
        assert log.record(f"key{rank}", [f"[h{rank}] gm: {code}", f"[p{rank}] process_group[0]: {group} (2@0,1)"],
                          name="MLP.forward", identity="shared") == "shared"
        log.close()
    keys = load_keys(tmp_path)
    assert {k: [i.graph for i in v] for k, v in keys.items()} == {"key0": ["shared"], "key2": ["shared"]}
