"""``python -m contribution_weights`` is ``cw`` (and what ``accelerate launch -m`` runs)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
