"""``python -m faceflow.prefect_main ARGS``: Prefect's ``prefect ARGS`` with the FaceFlow
stack's server-side fix installed first (``faceflow.prefect_schema_cache``).

The stack and the tests start Prefect's API and services this way
(``faceflow.prefect_server.api_argv``). The API's extra worker processes of the scale-out
layout (``--workers N``) are spawned and import this module again as ``__mp_main__``, so the
fix is installed in each of them too.
"""

from __future__ import annotations

import sys

from faceflow.prefect_schema_cache import install

install()

if __name__ == "__main__":
    from prefect.cli import app

    sys.argv[0] = "prefect"
    app()
