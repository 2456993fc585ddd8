"""Alerting: Prometheus rules rendered from the configuration's SLAs, scaling policy and budgets.

``alerts.rules`` is the pure rendering, ``alerts.cli`` the ``infermeter alerts`` command.
"""
