"""Plumbing shared by the three gridrl services: gRPC server wiring (health, reflection,
size limits, graceful shutdown), the one auth interceptor, the one metrics setup, channels,
addresses, click flags with environment variables, and the status-error type."""

__version__ = "0.1.0"
