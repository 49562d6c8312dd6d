"""Keys: stable across processes, distinct for any changed input, safe as file names and Redis keys."""

from __future__ import annotations

import pytest

import recipecache
from recipecache.backends.base import is_key
from recipecache.errors import ConfigError
from recipecache.keys import check_namespace, storage_key


def test_keys_are_stable_and_distinct() -> None:
    a = recipecache.make_key("g", [(8, 128)], fingerprint={"torch": "2.13"})
    assert a == recipecache.make_key("g", ((8, 128),), fingerprint={"torch": "2.13"})
    assert len(a) == 64
    assert a != recipecache.make_key("g", [(8, 129)], fingerprint={"torch": "2.13"})
    assert a != recipecache.make_key("g", [(8, 128)], fingerprint={"torch": "2.14"})
    assert a != recipecache.make_key("h", [(8, 128)], fingerprint={"torch": "2.13"})


@pytest.mark.parametrize("namespace", ["", "../evil", "a/b", ".hidden", "-x", "x" * 65, "job\n", "job\r", "jöb", "a b"])
def test_bad_namespaces_are_refused(namespace: str) -> None:
    with pytest.raises(ConfigError, match="bad namespace"):
        check_namespace(namespace)


def test_storage_keys_are_backend_keys() -> None:
    for key in ["", "k", "x" * 10_000, "pt2:fx-graph-v1::abc:c1", "\n\x00\udcff".encode(errors="surrogatepass").decode(errors="replace")]:
        skey = storage_key("job.v1-2_3", key)
        assert is_key(skey) and skey.startswith("job.v1-2_3/")
    assert storage_key("a", "k") != storage_key("b", "k") != storage_key("a", "k2")
    assert not is_key("job/" + "a" * 64 + "\n"), "a trailing newline is not a key"
