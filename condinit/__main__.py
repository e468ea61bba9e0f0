from condinit.cli import main

raise SystemExit(main())
