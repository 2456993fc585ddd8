"""``python -m launcher`` is the ``infermeter`` command."""

from launcher.cli import main

raise SystemExit(main())
