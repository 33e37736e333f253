from tokenwing.cli import main

raise SystemExit(main())
