"""Tests of the deployment manifests and the container image."""
