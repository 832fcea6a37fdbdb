"""Engines kvservice does not own (DESIGN §15): the KV store client their connectors use
(``kvservice.integrations.store``) and vLLM's KV connector (``kvservice.integrations.vllm``)."""
