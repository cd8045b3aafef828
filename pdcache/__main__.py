from __future__ import annotations

import sys

from pdcache.cli import main

sys.exit(main())
