"""LM heads, always in full-vocabulary index space: full, certified (CSV) and shortlist heads."""

from runtime.heads.certified import CertifiedHead
from runtime.heads.cluster_bound import ClusterBound
from runtime.heads.full import FullHead
from runtime.heads.screen_bound import ScreenBound

BOUNDS = ("screen", "screen4", "cluster")  # the certified head's bound families (csv:BOUND)

__all__ = ["BOUNDS", "CertifiedHead", "ClusterBound", "FullHead", "ScreenBound"]
