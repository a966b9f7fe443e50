"""Decode state of the reference model: every per-slot tensor a decode step reads and writes.

One `DecodeCaches` holds `num_slots` independent request slots. Its layout is the reference's own
(kernels may pack differently) but it follows DESIGN.md §6: KDA state v-first, conv windows of raw
q|k|v projections, the MLA latent cache, and for the kpool indexer only pooled keys plus the raw rows
of the pool still being filled. The MTP block's attention caches sit behind the trunk's DSA layers
(index `n_dsa`) and have their own length, since the block lags the trunk by one token.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

Tensor = torch.Tensor


@dataclass
class DecodeCaches:
    kda_state: Tensor     # [S, L_kda, nh, dv, dk] fp32, v-first
    conv_window: Tensor   # [S, L_kda, K-1, 3*kda_dim] fp32: last K-1 raw q|k|v rows, oldest first
    latent: Tensor        # [S, L_dsa + M, max_len, kv_lora] fp32: RMSNorm'd MLA latents per token
    pool_keys: Tensor     # [S, L_dsa + M, ceil(max_len / kpool), index_head_dim] fp32: complete pools
    tail_rows: Tensor     # [S, L_dsa + M, kpool, 2 * index_head_dim] fp32: [key | gate] of token t at row
                          # t % kpool, kept until its pool completes
    lengths: Tensor       # [S] int64: trunk tokens seen (= next trunk position)
    mtp_lengths: Tensor   # [S] int64: MTP rows seen (= next MTP position)
    max_len: int
    n_dsa: int            # trunk DSA layers; DSA cache index n_dsa is the MTP block

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0]

    @classmethod
    def allocate(cls, cfg, num_slots: int, max_len: int, device="cpu") -> "DecodeCaches":
        for name, v in (("num_slots", num_slots), ("max_len", max_len)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name}={v!r}: must be a positive integer")
        n_kda, n_dsa = len(cfg.kda_layers), len(cfg.dsa_layers)
        n_att = n_dsa + cfg.num_nextn_predict_layers
        kp, K = cfg.index_kpool, cfg.linear_conv_kernel_dim
        f32 = dict(dtype=torch.float32, device=device)
        return cls(
            kda_state=torch.zeros(num_slots, n_kda, cfg.linear_num_heads, cfg.linear_head_dim,
                                  cfg.linear_head_dim, **f32),
            conv_window=torch.zeros(num_slots, n_kda, K - 1, 3 * cfg.kda_dim, **f32),
            latent=torch.zeros(num_slots, n_att, max_len, cfg.kv_lora_rank, **f32),
            pool_keys=torch.zeros(num_slots, n_att, -(-max_len // kp), cfg.index_head_dim, **f32),
            tail_rows=torch.zeros(num_slots, n_att, kp, 2 * cfg.index_head_dim, **f32),
            lengths=torch.zeros(num_slots, dtype=torch.int64, device=device),
            mtp_lengths=torch.zeros(num_slots, dtype=torch.int64, device=device),
            max_len=max_len, n_dsa=n_dsa,
        )

    def tensors(self) -> dict[str, Tensor]:
        """Every state tensor by field name (for comparisons and dumps)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), Tensor)}

    def clone(self) -> "DecodeCaches":
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        kw.update({k: v.clone() for k, v in self.tensors().items()})
        return DecodeCaches(**kw)

    def reset(self, slot: int) -> None:
        """Empty one slot (zeros everywhere, lengths 0)."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot={slot}: outside [0, {self.num_slots})")
        for t in self.tensors().values():
            t[slot].zero_()
