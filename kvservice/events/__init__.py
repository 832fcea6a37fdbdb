"""KV events in vLLM's format (DESIGN §15): the wire format (``wire``), a publisher with a
replay socket (``publisher``), an index of which instance caches which block fed by the
events of vLLM instances (``index``, ``ingest``), and routing by it (``router``)."""
