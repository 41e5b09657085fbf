from tools.sim.cli import main

raise SystemExit(main())
