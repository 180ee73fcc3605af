"""``python -m ckptctl.demo``: see ``ckptctl.demo``."""

import sys

from ckptctl.demo.run import main

sys.exit(main())
