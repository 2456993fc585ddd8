"""Client strings are capped before they are stored, and metric labels come only from the configuration."""

from __future__ import annotations

import pytest

from sidecar.bounds import MAX_FIELD_CHARS, TRUNCATED, capped, label, shown


@pytest.mark.parametrize("size", [0, 1, MAX_FIELD_CHARS])
def test_short_values_are_stored_as_they_are(size):
    """A value within the cap is kept unchanged."""
    assert capped("m" * size) == "m" * size


def test_long_values_are_cut_with_a_marker():
    """A longer value keeps its head and ends in the marker, exactly at the cap."""
    value = capped("m" * 100_000)
    assert len(value) == MAX_FIELD_CHARS
    assert value.endswith(TRUNCATED)
    assert value.startswith("m" * 200)


def test_shown_values_are_shorter_still():
    """A name quoted back in an error message is cut to a few dozen characters."""
    assert len(shown("x" * 10_000)) == 64


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("chat-small", "chat-small"),
        ("llama-3.1-8b-instruct", "llama-3.1-8b-instruct"),
        ("made-up", "unknown"),
        ("", "unknown"),
    ],
)
def test_labels_are_registry_names_or_unknown(value, expected):
    """A metric label is the configured name itself, anything else is "unknown"."""
    assert label(value, frozenset({"chat-small", "llama-3.1-8b-instruct"})) == expected
