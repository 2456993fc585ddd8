"""``python -m infermeter`` is the ``infermeter`` command."""

from infermeter.cli import main

raise SystemExit(main())
