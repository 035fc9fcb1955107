"""FaceFlow: the ``faceflow`` command, the Python client and the local stack launcher."""

__version__ = "0.1.0"
