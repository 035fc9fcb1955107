"""The ``faceflow-gpu`` Prefect worker: warm children, hard deadlines, sub-second dispatch.

Importing this package registers the worker type with Prefect (it is the
``prefect.collections`` entry point ``faceflow``), so
``prefect worker start --pool gpu --type faceflow-gpu`` finds it.
"""

from faceflow.worker.job import FaceFlowJobConfiguration, FaceFlowVariables
from faceflow.worker.worker import (
    WORKER_TYPE,
    FaceFlowGpuWorker,
)

__all__ = ["WORKER_TYPE", "FaceFlowGpuWorker", "FaceFlowJobConfiguration", "FaceFlowVariables"]
