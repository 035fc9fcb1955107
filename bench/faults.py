"""The fault matrix as a script: ``.venv/bin/python bench/faults.py [--full] [--only N ...]``.

Same as ``faceflow selftest faults``; see ``faceflow.faults`` for what it does.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from faceflow.selftest import app

if __name__ == "__main__":
    app(["faults", *sys.argv[1:]])
