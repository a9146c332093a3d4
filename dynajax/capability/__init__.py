"""Per-node capability verdicts (data, never exceptions)."""

from dynajax.capability.support import CapabilityChecker
from dynajax.capability.verdict import (
    META_KEY,
    Reason,
    Supported,
    Unsupported,
    Verdict,
    strict_objections,
    target_name,
    verdict_of,
)

__all__ = [
    "META_KEY",
    "CapabilityChecker",
    "Reason",
    "Supported",
    "Unsupported",
    "Verdict",
    "strict_objections",
    "target_name",
    "verdict_of",
]
