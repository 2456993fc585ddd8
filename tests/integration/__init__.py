"""Tests that run the platform's processes together over loopback, as a fleet would."""
