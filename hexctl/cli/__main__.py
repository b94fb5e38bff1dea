import sys

from hexctl.cli import main

sys.exit(main())
