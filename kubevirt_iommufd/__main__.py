"""`python -m kubevirt_iommufd` runs the command line."""

import sys

from kubevirt_iommufd.cli import main

sys.exit(main())
