"""The vLLM backend: a local vLLM server as a backend (backend.py), its HTTP client
(client.py), its start-up probe (probe.py) and its HTTP contract (wire.py)."""
