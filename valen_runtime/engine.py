"""Engine: compiled request -> per-question logits -> Valen response.

Two execution modes compute the same function:
- "per-branch": the reference's shape. Every branch is one full forward of state + suffix from
  position 0 (batch 1, no cache), exactly as Valen runs it; the parity baseline.
- "shared-prefix": the state runs once; every branch continues from its final per-layer state
  (GDN recurrent state and conv tail, attention K/V) with all suffixes batched together. Exact
  in real arithmetic (the layers are causal); only rounding differs, measured by valen-parity.
The vision tower runs once per request in both modes (it is deterministic given the pixels).
The engine knows nothing about JSON validation or tokenization: request.py does that.
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .answers import answer_from_probabilities, batch_probabilities, response
from .request import CompiledRequest, Compiler, ImageInputs
from .positions import rope_index
from .qwen35 import Packing, TextCache
from .vision import frame_lengths, grid_list
from .weights import LoadedModel, load_model

MODES = ("per-branch", "shared-prefix")
# Shared-prefix layouts: a right-padded batch of branches after a prefix pass; the branches packed
# varlen in one row after it; the prefix in that same row (one sweep of the layers).
LAYOUTS = ("batch", "packed", "one-pass")
CHUNK = 64  # the chunk size of the reference's gated delta rule


@dataclass
class RunResult:
    response: dict
    compiled: CompiledRequest
    logits: list[torch.Tensor]  # per question, fp32 [K] on the CPU
    timings: dict = field(default_factory=dict)


@dataclass
class _Plan:
    """A request's shared-prefix inputs on the host; `sizes` is also the CUDA-graph key."""

    parts: list[torch.Tensor]  # int64: state ids [1, P], prefix positions [3, 1, cut], suffix ids [N, L - tail],
    # row positions [3, N, L], image token indices [n_img], head rows [C + N + C]
    sizes: tuple  # (P, cut, N, L, C, n_img); packed and one-pass: (P, cut, T, C, n_img, N, sequence lengths)
    candidates_per_branch: list[int]
    kind: str = "batch"  # the layout actually run: "batch", "packed", or "one-pass" (batch when the prefix is too short)

    def upload(self, device: torch.device) -> list[torch.Tensor]:
        """One copy (pinned, asynchronous on CUDA) of all parts, returned as views in order."""
        flat = torch.cat([p.reshape(-1) for p in self.parts])
        if device.type == "cuda":
            flat = flat.pin_memory().to(device, non_blocking=True)
        out, offset = [], 0
        for p in self.parts:
            out.append(flat[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out


def _head_index(branches, starts: list[int], cut: int) -> tuple[torch.Tensor, int]:
    """Head rows for branches whose first token (absolute position `cut`) sits at row starts[k]:
    [candidate rows (C) | decision rows (N) | branch of each candidate (C)] int64, and C."""
    cand_rows, cand_branch, dec_rows = [], [], []
    for k, (br, start) in enumerate(zip(branches, starts)):
        cand_rows += [start + p - cut for p in br.candidate_positions]
        cand_branch += [k] * len(br.candidate_positions)
        dec_rows.append(start + br.decision_position - cut)
    return torch.tensor(cand_rows + dec_rows + cand_branch, dtype=torch.int64), len(cand_rows)


class Engine:
    def __init__(
        self,
        model: LoadedModel,
        compiler: Compiler,
        mode: str = "per-branch",
        temperature: float = 1.0,
        kernels: str = "torch",
        graphs: bool = False,
        align_prefix: bool = True,
        compile: bool | None = None,
        layout: str | None = None,
        lora_gemm: str = "fp32",
    ):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        if kernels not in ("torch", "fast"):
            raise ValueError(f"kernels {kernels!r} is not torch or fast")
        if graphs and (mode != "shared-prefix" or model.device.type != "cuda"):
            raise ValueError("CUDA graphs need mode='shared-prefix' on a CUDA device")
        self.model = model
        self.compiler = compiler
        self.mode = mode
        self.temperature = temperature
        self.model_id = model.manifest.data.get("model_id", "valen-preview-0923")
        self.align_prefix = align_prefix
        self.kernels = {"gated_delta": "torch", "attention": "eager"}
        if kernels == "fast":
            from .fast import enable_fast_paths

            # torch.compile pays off for a long-lived engine on CUDA (the first request of a fresh
            # process compiles for about a minute); on the CPU the fused functions run eagerly.
            compile = model.device.type == "cuda" if compile is None else compile
            self.kernels = enable_fast_paths(model.text, model.vision, dtype=model.dtype, compile=compile, lora_gemm=lora_gemm)
        elif lora_gemm != "fp32":
            raise ValueError("lora_gemm other than fp32 needs kernels='fast'")
        # The packed layouts (no padding rows; "one-pass" also sweeps the layers once instead of
        # twice) need the fused layers, and under CUDA graphs FLA's varlen kernel; where they can
        # run on CUDA, "one-pass" is the default (docs/benchmarks.md, runs 5 and 6).
        fused = mode == "shared-prefix" and self.kernels.get("layers", "modules") != "modules"
        fla = str(self.kernels.get("gated_delta")).startswith("fla")
        if layout is None:
            layout = "one-pass" if fused and fla and model.device.type == "cuda" else "batch"
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
        if layout != "batch":
            if not fused:
                raise ValueError(f"layout={layout!r} needs mode='shared-prefix' and kernels='fast' (the fused layers)")
            if graphs and not fla:
                raise ValueError(f"layout={layout!r} with CUDA graphs needs flash-linear-attention's varlen kernel (bf16)")
        self.layout = layout
        # Start the vision tower from inside the request compile (Engine.run); only worth it where
        # the device runs asynchronously to the host.
        self.overlap_vision = model.device.type == "cuda"
        self.graphs = None
        if graphs:
            from .fast import GraphCache

            self.graphs = GraphCache()

    @classmethod
    def load(
        cls,
        export_dir: str | Path,
        device: str = "cpu",
        dtype: str = "bf16",
        verify: str = "size",
        mode: str | None = None,
        temperature: float = 1.0,
        kernels: str | None = None,
        graphs: bool | None = None,
        compile: bool | None = None,
        layout: str | None = None,
        lora_gemm: str = "fp32",
    ) -> "Engine":
        """Load an export.

        Defaults: on CUDA, shared-prefix mode with the fast path (fused layers compiled by
        torch.compile, flash-linear-attention when importable, SDPA) and CUDA graphs; on the CPU,
        per-branch mode with the pure-PyTorch path. Per-branch mode always runs the
        reference-faithful PyTorch path unless kernels="fast". compile=False keeps the fast path
        eager (no minute-long first request; slower after it). lora_gemm="bf16x3" runs the
        separate FP32 LoRA on tensor cores as exact bf16 splits (opt-in, bf16 only; see fast.py).
        layout (shared-prefix only): "batch" runs the branches as a right-padded batch after a
        prefix pass, "packed" as varlen sequences in one row after it, "one-pass" with the prefix in
        that same row (one sweep of the layers); default "one-pass" where it can run on CUDA (the
        fused layers with flash-linear-attention), else "batch" (docs/runtime.md).
        """
        model = load_model(export_dir, device=device, dtype=dtype, verify=verify)
        prompt = model.manifest.data["prompt"]
        compiler = Compiler.from_dir(model.manifest.root, max_length=prompt["max_length"], media_kwargs=prompt.get("media_kwargs") or {})
        cuda = model.device.type == "cuda"
        if mode is None:
            mode = "shared-prefix" if cuda else "per-branch"
        if kernels is None:
            kernels = "fast" if cuda and mode == "shared-prefix" else "torch"
        if graphs is None:
            graphs = cuda and mode == "shared-prefix"
        return cls(model, compiler, mode=mode, temperature=temperature, kernels=kernels, graphs=graphs, compile=compile, layout=layout,
                   lora_gemm=lora_gemm)

    # ---- pieces -------------------------------------------------------------------------

    @torch.no_grad()
    def image_features(self, compiled: CompiledRequest) -> torch.Tensor | None:
        images = compiled.state.image_inputs
        return None if images is None else self.vision_features(images)

    @torch.no_grad()
    def vision_features(self, images: ImageInputs) -> torch.Tensor:
        """The vision tower's output [n_image_tokens, H] (queued on the device, not awaited)."""
        m = self.model
        pixel_values = images.pixel_values_on(m.device)  # uint8 uploaded, patches made on the device
        if self.graphs is None:
            return m.vision(pixel_values, images.grid_thw)
        # Graphed per image-grid combination. The grid tables (weights only) are built when the
        # graph is captured; the graph cache keeps the closure, so they live as long as the graph.
        grids = grid_list(images.grid_thw)
        key = ("vision", tuple(grids))
        tables = None if key in self.graphs else m.vision.grid_tables(grids)
        lengths = frame_lengths(grids)
        (features,) = self.graphs.run(key, lambda px: (m.vision.encode(px, *tables, lengths),), [pixel_values])
        return features

    def _embed(self, ids: list[int], image_mask: torch.Tensor | None, features: torch.Tensor | None) -> torch.Tensor:
        m = self.model
        embeds = m.text.embed(torch.tensor([ids], device=m.device))  # [1, T, H]
        if features is not None:
            # As HF: image features replace the <|image_pad|> embeddings in order (no host sync).
            embeds = embeds.masked_scatter(image_mask.view(1, -1, 1), features.to(embeds.dtype))
        return embeds

    @torch.no_grad()
    def question_logits(self, compiled: CompiledRequest) -> list[torch.Tensor]:
        return self.question_logits_from_features(compiled, self.image_features(compiled))

    @torch.no_grad()
    def question_logits_from_features(self, compiled: CompiledRequest, features: torch.Tensor | None) -> list[torch.Tensor]:
        """Per-question logits given the vision tower's output (None for text-only states)."""
        if self.mode == "shared-prefix":
            return self._shared_prefix(compiled, features)
        rows = self._per_branch(compiled, features)
        # One head call per branch, concatenated per question: [K] fp32 each.
        return [torch.cat([self.model.head.logits(c, d) for c, d in branch_rows]) for branch_rows in rows]

    def _state_image_mask(self, compiled: CompiledRequest, length: int) -> torch.Tensor:
        types = torch.tensor(compiled.state.mm_token_type_ids + [0] * (length - len(compiled.state.mm_token_type_ids)))
        return (types == 1).to(self.model.device)

    def _per_branch(self, compiled: CompiledRequest, features) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        m, st = self.model, compiled.state
        merge = m.config.vision_config.spatial_merge_size
        rows = []
        for q in compiled.questions:
            q_rows = []
            for br in q.branches:
                ids = st.input_ids + br.suffix_ids
                types = st.mm_token_type_ids + [0] * len(br.suffix_ids)
                positions, _ = rope_index(ids, types, st.image_grid_thw, merge)  # [3, T]
                embeds = self._embed(ids, self._state_image_mask(compiled, len(ids)) if features is not None else None, features)
                hidden = m.text(embeds, positions[:, None, :].to(m.device))[0]  # [T, H]
                q_rows.append((hidden[br.candidate_positions], hidden[br.decision_position]))
            rows.append(q_rows)
        return rows

    def _shared_prefix(self, compiled: CompiledRequest, features) -> list[torch.Tensor]:
        m = self.model
        plan = self._plan(compiled)
        inputs = plan.upload(m.device)  # one host-to-device copy of every index the request needs
        if features is not None:
            inputs.append(features)
        if plan.kind == "batch":
            forward = functools.partial(self._planned_logits, plan.sizes)
        else:
            forward = functools.partial(self._packed_logits, plan.kind == "one-pass", plan.sizes)
        if self.graphs is None:
            (logits,) = forward(*inputs)
        else:
            key = (plan.kind, *plan.sizes)
            (logits,) = self.graphs.run(key, forward, inputs)
        per_branch = list(logits.split(plan.candidates_per_branch))  # [K_b] per branch
        out, k = [], 0
        for q in compiled.questions:
            out.append(torch.cat(per_branch[k : k + len(q.branches)]))
            k += len(q.branches)
        return out

    def _plan(self, compiled: CompiledRequest) -> "_Plan":
        """Everything shared-prefix execution needs from the host, as int64 tensors on the CPU."""
        m, st = self.model, compiled.state
        merge = m.config.vision_config.spatial_merge_size
        P = len(st.input_ids)
        positions, next_pos = rope_index(st.input_ids, st.mm_token_type_ids, st.image_grid_thw, merge)  # [3, P]
        # The shared part ends on a chunk boundary of the delta rule (64), so every branch sees the
        # reference's chunking; the state tail (< 64 tokens) is re-run with each branch.
        cut = (P // CHUNK) * CHUNK if self.align_prefix else P
        branches = [br for q in compiled.questions for br in q.branches]
        N, tail = len(branches), P - cut
        image_index = torch.tensor([i for i, t in enumerate(st.mm_token_type_ids) if t == 1], dtype=torch.int64)
        # One-pass needs an in-row prefix holding a whole conv history (K-1 rows); without one (a
        # state under 64 tokens: cut 0) the padded batch measured faster than packing (run 6, (b)).
        K = self.model.config.text_config.linear_conv_kernel_dim
        if self.layout == "packed" or (self.layout == "one-pass" and cut >= K - 1):
            return self._plan_packed(compiled, branches, positions, next_pos, cut, image_index)
        # Right padding is exact for the real tokens: every layer is causal, so a pad token never
        # influences an earlier position. Lengths round up to a multiple of 8 so graphs are reused.
        L = -(-(tail + max(len(br.suffix_ids) for br in branches)) // 8) * 8
        pad_id = branches[0].suffix_ids[-1]
        suffix_ids = torch.tensor([br.suffix_ids + [pad_id] * (L - tail - len(br.suffix_ids)) for br in branches])  # [N, L - tail]
        suffix_pos = torch.arange(next_pos, next_pos + L - tail).view(1, 1, -1).expand(3, N, -1)
        rows_pos = torch.cat([positions[:, None, cut:].expand(3, N, -1), suffix_pos], dim=2)  # [3, N, L]
        head_index, C = _head_index(branches, [k * L for k in range(N)], cut)  # rows of the flattened [N * L, H]
        parts = [torch.tensor([st.input_ids]), positions[:, None, :cut], suffix_ids, rows_pos, image_index, head_index]
        sizes = (P, cut, N, L, C, len(image_index))
        return _Plan(parts, sizes, [len(br.candidate_positions) for br in branches])

    def _planned_logits(self, sizes, state_ids, prefix_pos, suffix_ids, rows_pos, image_index, head_index, features=None):
        """Device part of shared-prefix execution (capturable: no host work): logits [C] fp32."""
        text = self.model.text
        P, cut, N, L, C, _ = sizes
        embeds = self._state_embeds(state_ids, image_index, features)  # [1, P, H]
        rows = torch.cat([embeds[:, cut:].expand(N, -1, -1), text.embed(suffix_ids)], dim=1)  # [N, L, H]
        if cut == 0:
            hidden = text(rows, rows_pos)  # nothing to share: one batched forward
        else:
            hidden = text(rows, rows_pos, cache=self._prefix_cache(embeds[:, :cut], prefix_pos).expand(N))
        return self._head_logits(hidden.reshape(N * L, -1), head_index, C, N)

    def _plan_packed(self, compiled: CompiledRequest, branches, positions: torch.Tensor, next_pos: int, cut: int,
                     image_index: torch.Tensor) -> "_Plan":
        """Branches as sequences [state tail | suffix] packed back to back in one row of T tokens
        (T rounded up to 8 with one extra pad sequence), each continuing the prefix state; in the
        one-pass layout, the prefix's own cut rows lead the row (cut + T rows, one sweep)."""
        st = compiled.state
        P = len(st.input_ids)
        tail = P - cut
        K = self.model.config.text_config.linear_conv_kernel_dim
        one_pass = self.layout == "one-pass"  # _plan checked that the prefix holds a whole conv history
        lengths = [tail + len(br.suffix_ids) for br in branches]
        T = -(-sum(lengths) // 8) * 8
        pad = T - sum(lengths)
        pad_id = branches[0].suffix_ids[-1]
        suffix_ids = [t for br in branches for t in br.suffix_ids] + [pad_id] * pad  # [S]
        seq_lengths = lengths + ([pad] if pad else [])
        # Row t takes its embedding from [state rows (P) | suffix tokens (S)].
        source, pos_parts, starts, s_offset = [], [], [], P
        for br in branches:
            starts.append(len(source))
            source += list(range(cut, P)) + list(range(s_offset, s_offset + len(br.suffix_ids)))
            s_offset += len(br.suffix_ids)
            pos_parts += [positions[:, cut:], torch.arange(next_pos, next_pos + len(br.suffix_ids)).view(1, -1).expand(3, -1)]
        source += list(range(s_offset, s_offset + pad))
        pos_parts.append(torch.arange(next_pos, next_pos + pad).view(1, -1).expand(3, -1))
        rows_pos = torch.cat(pos_parts, dim=1)[:, None, :]  # [3, 1, T]
        seq_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(seq_lengths)])
        offsets = torch.cat([torch.arange(n) for n in seq_lengths])
        # Conv tap j of token t reads t + j in [prefix conv tail (K-1) | row], or, before its
        # sequence starts, the shared prefix tail at offset + j.
        rows = torch.arange(T)
        taps = torch.stack([torch.where(offsets + j >= K - 1, rows + j, offsets + j) for j in range(K)])  # [K, T]
        cu_seqlens = torch.tensor([0] + list(itertools.accumulate(seq_lengths)))
        chunk_indices = torch.tensor([[i, c] for i, n in enumerate(seq_lengths) for c in range(-(-n // CHUNK))]).view(-1, 2)
        if one_pass:
            # [prefix rows 0..cut | the packed row]: the prefix taps read zeros before its start, the
            # branches' taps move past the prefix rows (their "history" indices are prefix rows too).
            source = list(range(cut)) + source
            rows_pos = torch.cat([positions[:, None, :cut], rows_pos], dim=2)
            seq_ids = torch.cat([torch.full((cut,), -1), seq_ids])
            offsets = torch.cat([torch.arange(cut), offsets])
            prefix_taps = torch.stack([torch.arange(cut) + j for j in range(K)])  # [K, cut]
            taps = torch.cat([prefix_taps, taps + cut], dim=1)
            starts = [start + cut for start in starts]
        head_index, C = _head_index(branches, starts, cut)
        # Every sequence length is part of the key: the varlen kernels' launch grids depend on them.
        sizes = (P, cut, T, C, len(image_index), len(branches), tuple(seq_lengths))
        # The last part: one-pass, prefix_rows (its length marks the in-row prefix); else the cached
        # prefix pass's positions.
        prefix = torch.arange(cut) if one_pass else positions[:, None, :cut]
        parts = [torch.tensor([st.input_ids]), torch.tensor(suffix_ids, dtype=torch.int64), torch.tensor(source), rows_pos,
                 image_index, head_index, seq_ids, offsets, taps, cu_seqlens, chunk_indices, prefix]
        kind = "one-pass" if one_pass else "packed"
        return _Plan(parts, sizes, [len(br.candidate_positions) for br in branches], kind=kind)

    def _packed_logits(self, one_pass: bool, sizes, state_ids, suffix_ids, source, rows_pos, image_index, head_index,
                       seq_ids, offsets, taps, cu_seqlens, chunk_indices, prefix, features=None):
        """`_planned_logits` for packed branches: one row of T tokens, no padding rows. `prefix` is
        the cached prefix pass's positions [3, 1, cut], or with one_pass the in-row prefix's
        `prefix_rows` [cut] (the row then holds cut + T tokens and the layers run once, no cache)."""
        text = self.model.text
        P, cut, T, C, _, N, _ = sizes
        embeds = self._state_embeds(state_ids, image_index, features)  # [1, P, H]
        rows = torch.cat([embeds[0], text.embed(suffix_ids)])[source][None]  # [1, T or cut + T, H]
        if one_pass:
            cache, packing = None, Packing(seq_ids, offsets, taps, cu_seqlens, chunk_indices, prefix)
        else:
            cache = self._prefix_cache(embeds[:, :cut], prefix) if cut > 0 else None
            packing = Packing(seq_ids, offsets, taps, cu_seqlens, chunk_indices)
        hidden = text(rows, rows_pos, cache=cache, packing=packing)
        return self._head_logits(hidden[0], head_index, C, N)

    # Pieces of the device functions above (capturable: no host work).
    def _state_embeds(self, state_ids: torch.Tensor, image_index: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """[1, P, H]; as HF's masked_scatter, image features replace the <|image_pad|> embeddings in order."""
        embeds = self.model.text.embed(state_ids)
        if features is not None:
            embeds = embeds.index_copy(1, image_index, features[None].to(embeds.dtype))
        return embeds

    def _prefix_cache(self, embeds: torch.Tensor, positions: torch.Tensor) -> TextCache:
        """Run the shared prefix [1, cut, H] once; its per-layer state is what every branch continues."""
        cache = self.model.text.new_cache()
        self.model.text(embeds, positions, cache=cache)
        return cache

    def _head_logits(self, flat: torch.Tensor, head_index: torch.Tensor, C: int, N: int) -> tuple[torch.Tensor]:
        """The head for every branch at once from hidden rows [R, H]: logits [C] fp32."""
        head = self.model.head
        c = head.candidate(flat[head_index[:C]].float())  # [C, P]
        d = head.decision(flat[head_index[C : C + N]].float())  # [N, P]
        return ((c * d[head_index[C + N :]]).sum(-1) / head.scale,)

    # ---- whole requests ---------------------------------------------------------------------

    def run(self, request: dict) -> RunResult:
        t0 = time.perf_counter()
        started: list[torch.Tensor] = []
        # On CUDA the vision tower is queued as soon as the images are decoded, so it runs on the
        # GPU while the host tokenizes the state and the questions (same stream: nothing waits).
        on_images = (lambda images: started.append(self.vision_features(images))) if self.overlap_vision else None
        compiled = self.compiler.compile(request, on_images)
        t1 = time.perf_counter()
        features = started[0] if started else self.image_features(compiled)
        logits = self.question_logits_from_features(compiled, features)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        probs, host_logits = batch_probabilities(logits, [len(q.keys) for q in compiled.questions], self.temperature)
        answers = {
            q.qid: answer_from_probabilities(q.kind, q.keys, q.descriptions, p) for q, p in zip(compiled.questions, probs)
        }
        resp = response(compiled, answers, model_id=self.model_id)
        # compile_s: request parsing, image decoding and tokenization (plus queuing the vision tower
        # when it overlaps); model_s: the rest of the device work, until the logits are ready.
        return RunResult(resp, compiled, host_logits, {"compile_s": t1 - t0, "model_s": t2 - t1})

    def answer(self, request: dict) -> dict:
        return self.run(request).response
