from xds_server.cli import main

raise SystemExit(main())
