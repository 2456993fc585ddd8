"""The ``collectors`` package: its exported names, imported from their modules on first use."""

from __future__ import annotations

import importlib

import pytest

import collectors


@pytest.mark.parametrize("name", collectors.__all__)
def test_every_export_is_its_modules_object(name):
    """Each name in ``collectors.__all__`` is the very object of the module that defines it."""
    value = getattr(collectors, name)
    assert getattr(importlib.import_module(value.__module__), name) is value


def test_an_unknown_name_is_an_attribute_error():
    """A name the package does not export raises AttributeError, as for any module."""
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = collectors.nope
