from ptb.cli import main

raise SystemExit(main())
