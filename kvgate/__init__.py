"""kvgate: a KV-cache-aware gateway for fleets of vLLM replicas."""

__version__ = "0.1.0"
