"""Tests of the autoscaler: policy rules, hooks, inputs, replay and the command line."""
