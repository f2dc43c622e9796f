from kvcert.bench.cli import main

raise SystemExit(main())
