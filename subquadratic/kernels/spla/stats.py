"""Block statistics of SPLA's selection (an internal structure of the op): running per-block sums of
the post-RoPE keys, updated with the new keys only, and the feature map phi of the residual term."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..triton_utils import HALF_DTYPES
from ..utils import acc_dtype


def feature_map(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = softmax over the head dimension, in fp32 or fp64 (the parameter-free exponential map)."""
    return torch.softmax(x, dim=-1, dtype=acc_dtype(x))  # the cast inside the softmax, no fp32 copy of x


#: whether this PyTorch has the batched matmul with an fp32 output for 16-bit operands (`torch.bmm(..., out_dtype=)`)
_BMM_OUT_DTYPE = hasattr(torch.ops.aten.bmm, "dtype")


def state_increment(phik: torch.Tensor, v: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """sum_s phik[b, h, s]^T v[b, h, s] -> [B, H, D, E] in `acc`: what the new tokens add to the residual
    linear state Sbar. phik [B, H, S, D] (the feature map, zero at padding), v [B, H, S, E] (any strides).
    16-bit values on CUDA with an fp32 state: one batched matmul on the tensor cores, phik rounded to
    v's dtype, fp32 accumulation and output (the operands the causal linear term's kernels take);
    otherwise exact in `acc`."""
    if v.is_cuda and v.dtype in HALF_DTYPES and acc == torch.float32 and _BMM_OUT_DTYPE:
        B, H, S, D = phik.shape
        a = phik.to(v.dtype).reshape(B * H, S, D).transpose(1, 2)
        return torch.bmm(a, v.reshape(B * H, S, v.shape[-1]), out_dtype=torch.float32).view(B, H, D, -1)
    return torch.einsum("bhsd,bhse->bhde", phik.to(acc), v.to(acc))


def new_tokens(k: torch.Tensor, v: torch.Tensor, tq: int, new_kv=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values [B, Tq, H, D] of the Tq new tokens: the last Tq slots of k, v [B, S, H, D],
    or `new_kv` where the new tokens sit elsewhere (a static cache's whole buffers)."""
    return (k[:, k.shape[1] - tq:], v[:, v.shape[1] - tq:]) if new_kv is None else new_kv


@dataclass
class BlockStats:
    """Running per-block sums of post-RoPE keys: sum_k, sum_k2 [B, H, NB, D] fp32, count [B, NB] fp32."""

    sum_k: torch.Tensor
    sum_k2: torch.Tensor
    count: torch.Tensor

    @classmethod
    def empty(cls, batch: int, heads: int, dim: int, device, dtype=torch.float32, num_blocks: int = 0) -> BlockStats:
        z = torch.zeros(batch, heads, num_blocks, dim, device=device, dtype=dtype)
        return cls(z, z.clone(), torch.zeros(batch, num_blocks, device=device, dtype=dtype))

    @property
    def num_blocks(self) -> int:
        return self.count.shape[1]

    def add(self, k: torch.Tensor, pos: torch.Tensor, block_size: int, num_blocks: int | None = None) -> BlockStats:
        """Return the stats with keys k [B, T, H, D] at logical positions pos [B, T] added (pads skipped);
        self is left unchanged. The result has max(self.num_blocks, num_blocks) blocks; `num_blocks`
        must be an upper bound of the blocks of pos (ceil(slots / block_size) is one). Without it the
        blocks needed are read from pos (a host synchronisation)."""
        B, T, H, D = k.shape
        if num_blocks is None:
            valid = pos >= 0
            num_blocks = int(pos.max().item()) // block_size + 1 if bool(valid.any()) else 0
        grow = max(0, num_blocks - self.num_blocks)
        out = BlockStats(
            torch.cat([self.sum_k, self.sum_k.new_zeros(B, H, grow, D)], dim=2),
            torch.cat([self.sum_k2, self.sum_k2.new_zeros(B, H, grow, D)], dim=2),
            torch.cat([self.count, self.count.new_zeros(B, grow)], dim=1),
        )
        return out.add_(k, pos, block_size)

    def add_(self, k: torch.Tensor, pos: torch.Tensor, block_size: int) -> BlockStats:
        """Add keys k [B, T, H, D] at logical positions pos [B, T] in place (pads skipped), with no host
        synchronisation; every block of pos must be < self.num_blocks. The sums never join an autograd
        graph (k is detached: selection does not propagate gradients). Returns self."""
        B, T, H, D = k.shape
        if T == 0 or self.num_blocks == 0:
            return self
        valid = pos >= 0
        blk = torch.where(valid, pos // block_size, 0)  # [B, T]
        w = valid.to(self.sum_k.dtype)
        kf = k.detach().transpose(1, 2).to(self.sum_k.dtype) * w[:, None, :, None]  # [B, H, T, D]
        idx = blk[:, None, :, None].expand(B, H, T, D)
        self.sum_k.scatter_add_(2, idx, kf)
        self.sum_k2.scatter_add_(2, idx, kf * kf)
        self.count.scatter_add_(1, blk, w)
        return self
