"""The one rule for numbers a person types (:mod:`recipecache.quantities`) and the sizes built on it."""

from __future__ import annotations

import pytest

from recipecache import quantities
from recipecache.errors import ConfigError
from recipecache.sizes import parse_size

#: what Python's readers take and the rule does not: other scripts' digits, signs, exponents, separators, spaces
NOT_NUMBERS = ["²", "٣", "３", "+3", "-3", "1e3", "1_0", "", " ", " 3", "3 ", "0x3", "nan", "inf", "3.", ".5", "1.2.3"]


@pytest.mark.parametrize("text", NOT_NUMBERS, ids=repr)
def test_only_ascii_digits_are_numbers(text: str) -> None:
    assert quantities.whole(text, 0, 10**9) is None
    assert quantities.decimal(text, 0, 10**9) is None
    with pytest.raises(ConfigError, match="bad size"):
        parse_size(text)
    with pytest.raises(ConfigError) as info:
        quantities.whole_number("--count", text, 1, 9)
    assert str(info.value).startswith("--count=") and "\n" not in str(info.value)


def test_numbers_by_the_rule_within_bounds() -> None:
    assert quantities.whole("0042", 1, 42) == 42
    assert quantities.whole("43", 1, 42) is None
    assert quantities.whole("4.5", 1, 42) is None
    assert quantities.decimal("2.5", 1, 3) == 2.5
    assert quantities.decimal("3.5", 1, 3) is None


def test_a_huge_number_is_out_of_range_not_a_crash() -> None:
    huge = "9" * 5000  # past int()'s limit for strings (4300 digits), and infinite as a float
    assert quantities.whole(huge, 0, 2**63) is None
    assert quantities.decimal(huge, 0, float("inf")) is None
    with pytest.raises(ConfigError, match="bad size"):
        parse_size(huge + "GB")


def test_sizes_are_exact() -> None:
    assert parse_size("0.1KB") == 100
    assert parse_size("2.5 GiB") == 5 * 1024**3 // 2
    with pytest.raises(ConfigError, match="not a whole number of bytes"):
        parse_size("0.5")
