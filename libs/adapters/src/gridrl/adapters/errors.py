"""The one error type of gridrl.adapters."""

from __future__ import annotations


class AdapterError(ValueError):
    """An adapter that cannot be read, converted, verified or loaded as asked.

    The message says what and where (file, tensor or config field) and, for a refused
    conversion, what the target format cannot express. A ``ValueError`` so callers that map bad
    input to INVALID_ARGUMENT can catch it generically.
    """
