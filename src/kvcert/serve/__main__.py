from kvcert.serve.cli import main

raise SystemExit(main())
