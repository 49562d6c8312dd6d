"""The docs' table of the metrics file's fields is the schema's, and the writer writes exactly the schema's fields
(issue 45: a field was named once where it was written and again where it was read, and the docs listed fields
the writer had dropped)."""

from __future__ import annotations

import re
from typing import Any

import recipecache
from harness.paths import REPO
from recipecache import metrics_schema
from recipecache.torch_integration.metrics import Metrics

TABLE = re.compile(r"<!-- metrics fields: begin -->\n(.*?)\n<!-- metrics fields: end -->", re.DOTALL)


def test_the_docs_table_of_metrics_fields_is_the_schemas() -> None:
    found = TABLE.search((REPO / "docs" / "DEVELOPING.md").read_text())
    assert found, "docs/DEVELOPING.md lost its table of metrics fields (the markers around it)"
    assert found.group(1) == metrics_schema.markdown_table(), (
        "docs/DEVELOPING.md's table of metrics fields is not recipecache.metrics_schema's; replace it with "
        "metrics_schema.markdown_table():\n" + metrics_schema.markdown_table()
    )


def _written_paths(
    data: dict[str, Any], declared: set[tuple[str, ...]], prefix: tuple[str, ...] = ()
) -> set[tuple[str, ...]]:
    """The paths of ``data`` down to a declared field (whose value is the field's, whatever it holds) or a value."""
    paths = set()
    for name, value in data.items():
        path = (*prefix, name)
        if path not in declared and isinstance(value, dict):
            paths |= _written_paths(value, declared, path)
        else:
            paths.add(path)
    return paths


def test_the_writer_writes_the_schemas_fields_in_its_order() -> None:
    store = recipecache.open_store("memory://", namespace="schema")
    metrics = Metrics(store, None, flush=False)
    metrics.enabled(1.0, 2.0)
    snapshot = metrics.snapshot()
    declared = {field.path for field in metrics_schema.FIELDS}
    # the fields the file holds whatever happened: those under no other field (a section of graphs, kinds, ...)
    outermost = [
        field.path
        for field in metrics_schema.FIELDS
        if not any(field.path[:end] in declared for end in range(1, len(field.path)))
    ]
    assert sorted(_written_paths(snapshot, declared)) == sorted(outermost)
    assert list(snapshot) == list(dict.fromkeys(path[0] for path in outermost)), "the file's order is the schema's"
    assert metrics_schema.ENABLE_S.read(snapshot) == 1.0


def test_a_reader_finds_a_field_at_its_former_path() -> None:
    """Run directories outlive a release: no-stall's rows were ``behind.graphs`` once."""
    rows = {"k": {"eager_calls": 1}}
    assert metrics_schema.NO_STALL_GRAPHS.read({"behind": {"graphs": rows}}) == rows
    assert metrics_schema.NO_STALL_GRAPHS.read({"no_stall": {"graphs": rows}}) == rows
    assert metrics_schema.NO_STALL_GRAPHS.read({"no_stall": 3}) is None, "a damaged section reads as absent"
