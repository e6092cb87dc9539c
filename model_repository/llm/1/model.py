"""`llm`: the colocated engine (prefill and decode in one process)."""
import triton_python_backend_utils as pb_utils

from backends.triton_adapter import EngineModel


class TritonPythonModel(EngineModel):
    pb = pb_utils
    role = "colocated"
