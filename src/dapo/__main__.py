import sys

from dapo.cli import main

sys.exit(main())
