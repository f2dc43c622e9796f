"""`python -m kvcert.studies.study4 <command>`: study 4's command line (kvcert.studies.study4.cli)."""

from kvcert.studies.study4.cli import main

raise SystemExit(main())
