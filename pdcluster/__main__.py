from pdcluster.cli import main

raise SystemExit(main())
