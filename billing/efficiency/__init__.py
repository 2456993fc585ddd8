"""The efficiency advisor: where the GPU money goes, and what would save it, from measured use."""

from billing.efficiency.advice import Policy, Recommendation, advise
from billing.efficiency.store import Report, read_report

__all__ = ["Policy", "Recommendation", "Report", "advise", "read_report"]
