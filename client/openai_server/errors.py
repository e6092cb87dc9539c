"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with its HTTP status."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from client.openai_server.protocol import ErrorBody, ErrorResponse

TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorBody(message=self.message, type=TYPES.get(self.status, "server_error"),
                                             param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def unsupported(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param, "unsupported_parameter")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


def unavailable(url: str, detail: str) -> APIError:
    return APIError(503, f"the Triton server at {url} is not reachable: {detail}", None, "service_unavailable")
