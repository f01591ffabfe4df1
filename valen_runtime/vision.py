"""Qwen3.5 vision tower (`model.visual`) as plain nn.Modules, mirroring transformers 5.4.0.

Parameter names equal the HF names with `model.visual.` stripped. Numerics follow 5.4.0's eager
path: Conv3d patch embed on input cast to the weight dtype, learned position table bilinearly
interpolated with weights rounded to the table dtype (5.4.0-specific, see docs/numerics.md),
2-D rotary in fp32, bidirectional attention within each image (cu_seqlens split), exact-GELU
merger. Image preprocessing (resize, normalise, patchify) and scattering the output into the text
embeddings are left to other modules.

Shape letters: N patches, M = N / merge^2 merged tokens, E hidden size, Hh heads, D head dim,
P = in_channels * temporal_patch * patch^2 pixel values per patch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from valen_runtime.cancel import checkpoint
from valen_runtime.config import VisionConfig
from valen_runtime.qwen35 import rotate_half


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.in_channels = cfg.in_channels
        self.temporal_patch_size = cfg.temporal_patch_size
        self.patch_size = cfg.patch_size
        self.embed_dim = cfg.hidden_size
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, P] -> [N, E] in the weight dtype."""
        w = self.proj.weight
        x = pixel_values.view(-1, self.in_channels, self.temporal_patch_size, self.patch_size, self.patch_size)
        return self.proj(x.to(device=w.device, dtype=w.dtype)).view(-1, self.embed_dim)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))  # gelu_pytorch_tanh


def apply_rotary_vision(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """RoPE in fp32 on q, k [N, Hh, D] with cos, sin [N, D]; results cast back to the input dtype."""
    q_dtype, k_dtype = q.dtype, k.dtype
    q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()  # [N, 1, D]
    q_out = (q * cos) + (rotate_half(q) * sin)
    k_out = (k * cos) + (rotate_half(k) * sin)
    return q_out.to(q_dtype), k_out.to(k_dtype)


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """Unmasked eager attention: q, k, v [1, Hh, n, D] -> [1, n, Hh, D] (softmax in fp32, cast back)."""
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(1, 2).contiguous()


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.scaling = cfg.head_dim**-0.5
        self.qkv = nn.Linear(cfg.hidden_size, cfg.hidden_size * 3, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.rotated_heads(x, cos, sin)
        # Each image (frame) attends only to itself: run eager attention per cu_seqlens chunk.
        out = torch.cat([bidirectional_attention(qc, kc, vc, self.scaling) for qc, kc, vc in per_frame(q, k, v, lengths)], dim=1)
        return self.proj(out.reshape(x.shape[0], -1).contiguous())  # [1, N, Hh, D] -> [N, E]

    def rotated_heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [N, E] -> q, k (rotary applied), v, each [1, Hh, N, D]."""
        n = x.shape[0]
        # [N, 3E] -> [3, N, Hh, D] -> q, k, v [N, Hh, D]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = apply_rotary_vision(q, k, cos, sin)
        return tuple(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))


def per_frame(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]):
    """(q, k, v) chunks [1, Hh, n, D] of each frame's patches (the cu_seqlens split)."""
    return zip(*(torch.split(t, lengths, dim=2) for t in (q, k, v)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, lengths, cos, sin):
        x = x + self.attn(self.norm1(x), lengths, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm per patch, then each merge x merge window (contiguous rows) -> one text-sized token."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.merged_size = cfg.hidden_size * cfg.spatial_merge_size**2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size, bias=True)
        self.linear_fc2 = nn.Linear(self.merged_size, cfg.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.merged_size)  # [N, E] -> [M, merge^2 * E]
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))  # exact GELU (nn.GELU())


def grid_list(grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
    """[n, 3] (t, h, w) tensor -> list of int triples (read on the host)."""
    return [tuple(int(v) for v in row) for row in torch.as_tensor(grid_thw).reshape(-1, 3).tolist()]


def frame_lengths(grids: list[tuple[int, int, int]]) -> list[int]:
    """Patches per frame: the cu_seqlens differences of the bidirectional attention."""
    return [h * w for t, h, w in grids for _ in range(t)]


class VisionModel(nn.Module):
    """Qwen3_5VisionModel: patch embed + interpolated position table + blocks + merger."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.merge = cfg.spatial_merge_size
        self.grid_side = cfg.num_grid_per_side
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        # Qwen3_5VisionRotaryEmbedding(head_dim // 2), theta 10000: fp32 on the CPU, outside the state dict.
        dim = cfg.head_dim // 2
        self.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, P] (fp32 from the processor), grid_thw [n, 3] -> [M, out_hidden] in the model dtype."""
        grids = grid_list(grid_thw)
        return self.encode(pixel_values, *self.grid_tables(grids), frame_lengths(grids))

    def grid_tables(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What depends on the grids only: position embeddings [N, E] and rotary cos, sin [N, D] fp32."""
        device = self.pos_embed.weight.device
        return (self.position_embeddings(grids), *self.rotary(grids, device))

    def encode(self, pixel_values: torch.Tensor, pos_embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               lengths: list[int]) -> torch.Tensor:
        """The tower on given grid tables: no host work, so it can be captured as a CUDA graph."""
        x = self.patch_embed(pixel_values)  # [N, E]
        x = x + pos_embeds
        for block in self.blocks:
            checkpoint()  # a served request given up stops here (cancel.py)
            x = block(x, lengths, cos, sin)
        return self.merger(x)

    def position_embeddings(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Bilinear (align_corners) resample of the learned grid to each image, in merge order: [N, E].

        5.4.0 rounds the four corner weights to the table dtype and forms the products and the sum
        ((p00 + p01) + p10) + p11 in that dtype (5.9+ keeps them fp32); reproduced here.
        """
        table = self.pos_embed.weight
        n = self.grid_side
        idx, wts = [[] for _ in range(4)], [[] for _ in range(4)]
        for _, h, w in grids:
            hs = torch.linspace(0, n - 1, h)  # fp32 sample coordinates
            ws = torch.linspace(0, n - 1, w)
            h0, w0 = hs.int(), ws.int()
            h1, w1 = (h0 + 1).clip(max=n - 1), (w0 + 1).clip(max=n - 1)
            dh, dw = hs - h0, ws - w0
            rows0, rows1 = h0 * n, h1 * n
            corners = ((rows0, w0), (rows0, w1), (rows1, w0), (rows1, w1))
            weights = ((1 - dh, 1 - dw), (1 - dh, dw), (dh, 1 - dw), (dh, dw))
            for c, ((r, col), (wr, wc)) in enumerate(zip(corners, weights)):
                idx[c].append((r[:, None] + col[None, :]).flatten())  # [h*w]
                wts[c].append((wr[:, None] * wc[None, :]).flatten())  # fp32 products
        index = torch.stack([torch.cat(i) for i in idx]).to(device=table.device, dtype=torch.long)  # [4, sum h*w]
        weight = torch.stack([torch.cat(w) for w in wts]).to(device=table.device, dtype=table.dtype)  # rounded
        corners = F.embedding(index, table) * weight[:, :, None]  # [4, sum h*w, E] in table dtype
        summed = corners[0] + corners[1] + corners[2] + corners[3]

        out = []
        m = self.merge
        for pe, (t, h, w) in zip(summed.split([h * w for _, h, w in grids]), grids):
            pe = pe.repeat(t, 1)  # [t*h*w, E]
            # Row-major grid -> merge order: each m x m window becomes m^2 consecutive rows.
            pe = pe.view(t, h // m, m, w // m, m, -1).permute(0, 1, 3, 2, 4, 5).flatten(0, 4)
            out.append(pe)
        return torch.cat(out)

    def rotary(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """2-D rotary angles: the first half of the frequencies follow the patch row, the second the column."""
        m = self.merge
        max_hw = max(max(h, w) for _, h, w in grids)
        inv_freq = self.inv_freq.to(device)
        table = torch.outer(torch.arange(max_hw, device=device, dtype=inv_freq.dtype), inv_freq)  # [max_hw, D/4]
        coords = []
        for t, h, w in grids:
            # Full-resolution (row, col) of each patch, listed in merge order.
            rows = (torch.arange(h // m)[:, None, None, None] * m + torch.arange(m)[None, None, :, None])
            cols = (torch.arange(w // m)[None, :, None, None] * m + torch.arange(m)[None, None, None, :])
            rows = rows.expand(h // m, w // m, m, m).reshape(-1)
            cols = cols.expand(h // m, w // m, m, m).reshape(-1)
            coords.append(torch.stack((rows, cols), dim=-1).repeat(t, 1))
        pos = torch.cat(coords).to(device)  # [N, 2]
        freqs = table[pos].flatten(1)  # [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
        return emb.cos(), emb.sin()
