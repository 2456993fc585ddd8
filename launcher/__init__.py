"""The composition root: the ``infermeter`` command, the local fleet and the demo.

The one package that imports every part of the platform; none imports it back (an import-linter
contract holds both). The parts below it are wired here: each part's command-line module is
registered with the command, and the local fleet (``simulate``, ``demo``) is started as processes.
Run it as the ``infermeter`` console script or ``python -m launcher``.
"""
