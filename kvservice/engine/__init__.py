"""The continuous-batching engine over the SDK and the workers, and the demo."""

from kvservice.engine.engine import Engine
from kvservice.engine.requests import (Completion, EngineBusy, Handle, Output, Progress, Report, Request,
                                       RequestError)

__all__ = ["Completion", "Engine", "EngineBusy", "Handle", "Output", "Progress", "Report", "Request", "RequestError"]
