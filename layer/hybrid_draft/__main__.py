"""``python -m hybrid_draft``: the ``hybrid-draft`` command, where no script is on PATH."""

import sys

from hybrid_draft.tools.cli import main

sys.exit(main())
