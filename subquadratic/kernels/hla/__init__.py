"""Pure-PyTorch second-order Higher-order Linear Attention (HLA) and asymmetric HLA.

`hla_naive` is the O(T^3) definition, `hla_recurrent` the streaming oracle
(decode), `hla_chunked` the chunked form (training / prefill). All take
q, k: [B, T, H, D], v: [B, T, H, Dv], log_alpha: [B, T, H] and share `HLAState`.
"""

from .chunk import hla_chunked
from .naive import hla_naive
from .recurrent import HLAState, clamp_signed, hla_recurrent

__all__ = ["HLAState", "clamp_signed", "hla_chunked", "hla_naive", "hla_recurrent"]
