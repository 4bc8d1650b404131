from xds_testbed.cli import main

raise SystemExit(main())
