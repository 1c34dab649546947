#!/usr/bin/env python3
"""Every grid point of an experiment: complete / partial (n of m) / failed / not started (`make status`).

    python scripts/sweep_status.py table1 [override ...]
"""

import sys

from keydiff.run import status

if __name__ == "__main__":
    sys.exit(status.main())
