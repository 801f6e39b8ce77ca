from fusedmoe.tools.cli import main

raise SystemExit(main())
