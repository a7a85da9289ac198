import sys

from photonic_testbed.gui.app import main

sys.exit(main())
