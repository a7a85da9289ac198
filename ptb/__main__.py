from photonic_testbed.ptb.cli import main

raise SystemExit(main())
