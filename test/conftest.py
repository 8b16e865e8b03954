"""pytest setup: the example's folder on sys.path (`import gpt`, `import pippy_dcp`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "checkpoint"))
