"""``python -m proxy.cli``: as the ``tierproxy`` script."""

import sys

from proxy.cli import main

sys.exit(main())
