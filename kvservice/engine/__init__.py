"""The continuous-batching engine over the SDK and the workers, and the demo."""

from kvservice.engine.engine import Completion, Engine, Progress, Report, Request

__all__ = ["Completion", "Engine", "Progress", "Report", "Request"]
