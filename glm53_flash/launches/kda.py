"""The `kda` launch: a KDA layer with the MoE FFN (31 of the 45 layers of GLM-5.3-Flash).

The mixer half is the shared KDA layer launch (launches/kda_layer.py, layer_host.py). The FFN half
(device side: launches/ffn_tasks.py):
  moe_route  [waits a] router partial tiles (BLOCK_E experts x one of ROUTER_PARTS K ranges, fp32
             logits) -> rl, and the shared expert's gate|up K slices -> hpart planes (hg)
  route      [waits rl] one task per row: the row's top-k -> its record (ids, weights) (sel); the
             shared expert's act tasks ride here ([waits hg] -> h)
  experts    [waits sel] slots over the (distinct expert, intermediate tile, K slice) items the record
             names: an expert's gate|up slice read once for every row that chose it -> epart planes (xe)
  act        [waits xe] the expert planes joined, clamped SwiGLU -> act_e (h); only wider than act_fold_width
             rows: up to it (1-2 rows) moe_down waits xe and joins its own expert group's activations
  down       [waits h] per row: the k experts' down tiles in rank order times their weights, then the
             shared expert's; in KG expert groups (dp) joined by down_join; TP 1: hc_post -> X_out;
             TP > 1: tagged pairs to every rank, rank-order sum in down_sum.
Expert weights are packed once at build into banks (kernels/moe.py pack_experts): w_gu [E, 2I, H],
w_d [E, H, I] (+ FP8 scales), this rank's intermediate shard.
"""
from __future__ import annotations

import os

import torch

from ..kernels.moe import pack_experts
from .ffn_tasks import ACT_COLS, ROUTER_BLOCK_E, expert_bn, router_rck
from ..schedule import NOMINAL_GRID, choose_groups
from .layer_host import KdaLayerLaunch

BLOCK_E = ROUTER_BLOCK_E   # experts per router tile
# GLM53_ROUTE_CLEAR=N (default 4; 0: placed by cost): the route's CTA takes no task of the N stages before the route
# (o_proj / o_sum / gate_ffn / moe_route in kda), so its cold dry run (ffn.WARM_CODE, ~7 us) runs while rl is still
# being computed. Placed by cost it sat behind a post1 that ends ~42 us in, and with the slice router its dry run
# ended ~3 us after the last partial. Measured (H100, nineteenth session, two rounds): kda TP8 -1.2 us against 0,
# the route's wait ending ~1 us after the last router partial (trace); sparse -0.3, nextn within the spread.
ROUTE_CLEAR = int(os.environ.get("GLM53_ROUTE_CLEAR", "4"))
# GLM53_PEER_D_EARLY=1 (A/B timings, with GLM53_SCHED_FILLER=1; default off, see schedule.FILLER_EARLY) adds the
# loopback peer_d stores to the route stage instead of the down_join stage.
PEER_D_EARLY = os.environ.get("GLM53_PEER_D_EARLY", "0") == "1"
ROUTER_PARTS = 16   # K ranges of the router GEMV, 256 columns each (4 parts: 72 tasks of 64 KB, ~30 us traced)


class KdaLaunch(KdaLayerLaunch):
    """KdaLaunch(cfg, checkpoint, layer, tp_rank=0, tp_size=1, width=1, device=None, grid=None)
    .run(X, kda_state, conv_window, *, inject_fault=None) -> X' (see KdaLayerLaunch)."""

    kind = "kda"
    # moe_down joins its own experts' activations (no act stage, one hop fewer) up to this width; wider, a row's
    # join is repeated by every down tile's task, so the act stage does it once. Same bits either way.
    # GLM53_ACT_FOLD_WIDTH sets it for A/B timings (0: never).
    act_fold_width: int = int(os.environ.get("GLM53_ACT_FOLD_WIDTH", "2"))

    @classmethod
    def site_names(cls, tp_size: int = 1, block_v_split: bool = False, down_groups: int = 1,
                   oproj_split: int = 1) -> list[str]:
        s = ["hp1", "a_in", "yin"] + (["oraw"] if block_v_split else []) + ["o"]
        s += (["xo"] if tp_size > 1 or oproj_split > 1 else []) + ["cf1", "hp2", "a", "rl", "hg", "sel", "xe", "h"]
        s += (["dp"] if down_groups > 1 else []) + ["cf2"] + (["xd"] if tp_size > 1 else [])
        return [f"kda.{n}" for n in s]

    def _ffn_names(self, p: str) -> list[str]:
        m = p + "mlp."
        names = [m + "gate.weight", m + "gate.e_score_correction_bias"]
        names += [f"{m}shared_experts.{n}_proj.weight" for n in ("gate", "up", "down")]
        names += [f"{m}experts.{e}.{n}_proj.weight" for e in range(self.cfg.n_routed_experts)
                  for n in ("gate", "up", "down")]
        return names

    def _load_ffn(self, w, sc, p) -> None:
        m = p + "mlp."
        self._gate_up(w, sc, m + "shared_experts.gate_proj.weight", m + "shared_experts.up_proj.weight")
        self.W_d, self.S_d = self._mat(w, sc, m + "shared_experts.down_proj.weight")
        self.I = self.W_g.shape[0]
        self.W_r = w[m + "gate.weight"].to(self.device, torch.float32).contiguous()
        self.bias_r = w[m + "gate.e_score_correction_bias"].to(self.device, torch.float32).contiguous()
        E = self.cfg.n_routed_experts
        experts = []
        for e in range(E):
            mats = [self._mat(w, sc, f"{m}experts.{e}.{n}_proj.weight") for n in ("gate", "up", "down")]
            experts.append(tuple(mt if mt[0].dtype == torch.float8_e4m3fn else mt[0] for mt in mats))
        fp8 = isinstance(experts[0][0], tuple)
        if fp8 != isinstance(experts[0][2], tuple):
            raise ValueError("kda: expert gate/up and down must share one format (bf16 or FP8)")
        gu, dn = pack_experts(experts)
        if fp8:
            (self.w_gu, self.s_gu), (self.w_de, self.s_de) = gu, dn
        else:
            self.w_gu, self.w_de = gu, dn
            self.s_gu, self.s_de = gu, dn
        self.moe, self.E, self.KE = True, E, self.cfg.num_experts_per_tok
        self.I_E = self.w_de.shape[2]
        self.fp8 = fp8 or self.W_g.dtype == torch.float8_e4m3fn
        if self.fp8 and 128 % self.block_n:
            raise ValueError(f"kda: FP8 needs block_n dividing 128, got {self.block_n}")
        # router K ranges: the fp32 router weight (4.7 MB at E = 288) over E / BLOCK_E x ROUTER_PARTS tasks;
        # a fixed count, not one derived from the grid, so the partials' join order (bits) is the same on
        # every grid
        self.router_ck = router_rck(self.H, ROUTER_PARTS, self.router_ck)     # 2 tiles cover a range
        split = -(-(-(-self.H // ROUTER_PARTS)) // self.router_ck) * self.router_ck
        self.r_split = split
        self.nrpart = -(-self.H // split)
        # gate|up K slices of the shared expert and of one row's expert slots (KE x I_E / BLOCK_N tiles: the
        # count of a single row, so every width gets the same split and the same bits)
        self.ks_gu = self.k_split_for(self.I, self.H, 2 * self.W_g.element_size())
        self.e_bn = expert_bn(self.block_n)                 # an expert item's gate rows (ffn_tasks.EXPERT_DIV)
        self.ks_e = self.k_split_for(self.KE * self.I_E, self.H, 2 * self.w_gu.element_size(), self.e_bn)
        # moe_down: each tile's KE + 1 expert GEMVs in groups over more CTAs, joined in down_join
        self.kg = self.down_groups or choose_groups(-(-self.H // self.block_n), self.KE + 1,
                                                     self.block_n * self.I_E * self.w_de.element_size())
        if (self.KE + 1) % self.kg:
            raise ValueError(f"{self.kind}: down_groups={self.kg} must divide the {self.KE + 1} expert GEMVs of a tile")
        self.act_fold = self.width <= self.act_fold_width

    def expert_slots(self) -> tuple[int, int]:
        """(slots, items a slot takes at most) of the experts stage. Its work items are (distinct expert, tile,
        K slice): each chosen expert's gate|up weights are read once whatever the width, every row that chose
        it applied to the same tile (ffn_tasks.expert_task). Which experts, and how many, the record says at
        run time; the graph is static, so slot q takes items q, q + slots, ... of those there are. As many
        slots as one row's items (every slot one item at 1 row, as before) or one wave of the nominal grid,
        whichever is more, and never more than the most items there can be (every row's picks distinct)."""
        items = -(-self.I_E // self.e_bn) * self.ks_e
        most = min(self.width * self.KE, self.E) * items
        slots = min(most, max(self.KE * items, NOMINAL_GRID))
        return slots, -(-most // slots)

    def _moe_down_tasks(self, g, row_bytes, reads, writes, box):
        """moe_down tasks (t0, n tiles, producer, expert group, rows first << 8 | count) over the tile ranges x KG
        groups x row groups (rows_per_task: a task walks its rows one after another, ~5 us a row at TP8, so at 8
        rows the 192 (tile, group) tasks took ~40 us of the path, 72 CTAs idle); the ranges are _gemv_stage's.
        Not at TP 1 with KG == 1, where the task's hc_post (_post_ffn) covers every row of its tiles."""
        ranges = self._stage_ranges(self.H, self.kg)
        per = self.rows_per_task(len(ranges) * self.kg) if (self.kg > 1 or self.tp_size > 1) else self.width
        s = 0
        for ks in range(self.kg):
            for (t0, n) in ranges:
                rows_n = min((t0 + n) * self.block_n, self.H) - t0 * self.block_n
                for r in range(0, self.width, per):
                    cnt = min(per, self.width - r)
                    g.add("moe_down", (t0, n, s, ks, (r << 8) | cnt if per < self.width else 0), reads=reads,
                          writes=writes, nbytes=rows_n * row_bytes * cnt // (self.kg * self.width))
                    s += 1
        if box is not None:
            self.n_box[box] = s
        return ranges

    def _ffn_graph(self, g, wb: int) -> None:
        H, tp, BN, W = self.H, self.tp_size, self.block_n, self.width
        wbe = 1 if self.w_gu.dtype == torch.float8_e4m3fn else 2
        g.stage("moe_route")
        slot = 0
        for p in range(self.nrpart):
            k0, k1 = p * self.r_split, min((p + 1) * self.r_split, H)
            for e0 in range(0, self.E, BLOCK_E):
                g.add("router", (e0, k0, k1, slot, p), reads=("a",), writes=("rl",),
                      nbytes=min(BLOCK_E, self.E - e0) * (k1 - k0) * 4)
                slot += 1
        self.n_box["rl"] = slot
        self._gemv_stage(g, "gu", self.I, 2 * H * wb, ("a",), ("hg",), "hg", k_split=self.ks_gu)
        route_stage = g.stage("route")
        for r in range(W):
            g.add("route", (r, r), reads=("rl",), writes=("sel",), nbytes=self.nrpart * self.E * 4,
                  clear=ROUTE_CLEAR)
        self.n_box["sel"] = W
        prod = self._act_tasks(g, 0)                    # the shared expert's h: off the critical path here
        g.stage("experts")
        n_slots, per_slot = self.expert_slots()
        for q in range(n_slots):
            g.add("expert", (q, n_slots, 0, 0, q), reads=("sel",), writes=("xe",),
                  nbytes=per_slot * 2 * self.e_bn * H * wbe // self.ks_e)
        self.n_box["xe"] = n_slots
        n = self.KE * self.I_E
        if not self.act_fold:
            g.stage("act")
            for r in range(W):
                for c0 in range(0, n, ACT_COLS):
                    g.add("act", (1, r, c0, min(c0 + ACT_COLS, n), prod), reads=("xe",), writes=("h",),
                          nbytes=2 * min(ACT_COLS, n - c0) * 4 * self.ks_e)
                    prod += 1
        self.n_box["h"] = prod
        g.stage("down")
        row_bytes = W * (self.KE * self.I_E * wbe + self.I * wb)
        rd = ("sel", "xe", "h") if self.act_fold else ("sel", "h")         # (site order as site_names)
        if self.kg > 1:
            ranges = self._moe_down_tasks(g, row_bytes, rd, ("dp",), "dp")
            self._down_join(g, ranges)
        elif tp == 1:
            ranges = self._gemv_stage(g, "moe_down", H, row_bytes, rd + self._hc_post_reads("cf2"), (),
                                      None, ret_ranges=True)
        else:
            ranges = self._moe_down_tasks(g, row_bytes, rd + self._hc_post_reads("cf2"), ("xd",), None)
        # PEER_D_EARLY (A/B, off): the loopback peers' xd stores in the route stage, before the CTAs' expert slots
        self._down_sum(g, ranges, peer_stage=route_stage if PEER_D_EARLY else None)
