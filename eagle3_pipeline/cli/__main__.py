"""``python -m eagle3_pipeline.cli``: the same command as ``eagle3-pipeline``."""

import sys

from eagle3_pipeline.cli import main

sys.exit(main())
