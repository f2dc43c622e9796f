from kvcert.studies.study5.cli import main

raise SystemExit(main())
