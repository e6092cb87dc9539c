"""`prefill`: the engine in the prefill role of the disaggregated path (see backends/disagg/prefill.py)."""
import triton_python_backend_utils as pb_utils

from backends.triton_adapter import EngineModel


class TritonPythonModel(EngineModel):
    pb = pb_utils
    role = "prefill"
