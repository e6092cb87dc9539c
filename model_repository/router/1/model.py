"""`router`: the disaggregated entry point (BLS over `prefill` and `decode`), same tensors as `llm`."""
import triton_python_backend_utils as pb_utils

from backends.disagg.router import RouterModel


class TritonPythonModel(RouterModel):
    pb = pb_utils
