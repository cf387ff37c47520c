import sys

from pipespec.cli import main

sys.exit(main())
