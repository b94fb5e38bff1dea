import sys

from areal_hex.cli import main

sys.exit(main())
