"""The vLLM backend: an HTTP client of a local vLLM server."""
