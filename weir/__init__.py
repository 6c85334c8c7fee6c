"""weir: a self-hosted batch LLM inference worker."""

__version__ = "0.1.0"
