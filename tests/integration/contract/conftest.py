"""The contract suite uses the integration tests' helpers for other users (``uid_support``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
