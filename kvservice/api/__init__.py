"""The OpenAI-compatible HTTP API over the engine: ``kvservice api`` (docs/engine.md)."""
