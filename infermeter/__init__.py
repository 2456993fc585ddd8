"""infermeter: observability and cost chargeback for GPU inference fleets that serve vLLM."""

__version__ = "0.1.0"
