from kvservice.cli import main

raise SystemExit(main())
