"""`python -m pt3func ...`: the same as the `pt3func` command."""

from pt3func.cli import main

raise SystemExit(main())
