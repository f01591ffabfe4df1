"""Engine: wire request -> per-question logits -> Valen response, in four steps.

- load: the export's weights (weights.py), its request compiler (request.py) and, with
  kernels="fast", the fast model built from the same weights (fast/); `EngineOptions` says how.
- prepare: validate and tokenize the request; the vision tower is queued as soon as the images
  are decoded, so on CUDA it runs while the host tokenizes (a video's frames are decoded last,
  once the prompt passed max_length, and the tower queued then).
- execute: the text stack and the head, in one of two modes computing the same function:
  "per-branch" (the reference's shape: every branch one forward of state + suffix from position
  0, batch 1, no cache; the parity baseline) or "shared-prefix" (the state once, every branch
  continuing from its per-layer state; exact in real arithmetic, rounding measured by
  valen-parity). Shared-prefix work is a `layouts.Plan` (`layouts.choose` picks its layout) run
  by its layout's forward, directly or, on CUDA, replayed from a CUDA graph keyed by `Plan.key`.
- finish: answers and the response JSON (answers.py) from the logits and their softmaxes, which
  were queued on the device behind the logits and copied to the host in one transfer
  (`queue_outputs`, in launch or right after execute).
`run_many` runs several requests as one batch (prepare_many -> launch -> collect): where the
engine runs the one-pass layout their rows share one sweep of the layers, each request with its
own prefix (layouts.one_pass); a request that fails is answered by its own exception.
The engine knows nothing about JSON validation or tokenization (request.py), and decides no
default: every choice comes resolved from its `EngineOptions`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from .answers import answer_from_probabilities, queue_probabilities, read_probabilities, response
from .cancel import Cancelled
from .layouts import LAYOUTS, Plan, choose, graph_plan, one_pass
from .options import EngineOptions
from .positions import rope_index
from .request import CompiledRequest, Compiler, ImageInputs, VideoInputs
from .vision import frame_lengths, grid_list
from .weights import DTYPES, LoadedModel, load_model

if TYPE_CHECKING:
    from .fast.model import FastModel


@dataclass
class RunResult:
    response: dict
    compiled: CompiledRequest
    logits: list[torch.Tensor]  # per question, fp32 [K] on the CPU
    timings: dict = field(default_factory=dict)


@dataclass
class Batch:
    """Requests between `Engine.prepare_many`, `launch` and `collect`."""

    prepared: list  # per request: (compiled, vision features or None), or the exception it raised
    plan: Plan | Exception | None  # as it runs (`Engine.served_plan`): one request's, or several's one-pass plan; None: each runs alone
    timings: dict
    # per ready request, its questions' logits then probabilities (`answers.queue_probabilities`) on
    # the host, once launched: on CUDA in pinned memory, filled by a copy queued in launch (read after `done`)
    outputs: list[torch.Tensor] | None = None
    error: Exception | None = None  # what the launch raised
    done: "torch.cuda.Event | None" = None  # on CUDA, recorded after the launched device work and that copy

    @property
    def ready(self) -> list[tuple[CompiledRequest, torch.Tensor | None]]:
        return [p for p in self.prepared if not isinstance(p, Exception)]


def vision_graph_key(grid_thw: torch.Tensor) -> tuple:
    """The CUDA-graph key of the vision tower on these grids ([n, 3] (t, h, w); a video's t frame pairs)."""
    return ("vision", tuple(grid_list(grid_thw)))


class Engine:
    def __init__(self, model: LoadedModel, compiler: Compiler, options: EngineOptions, temperature: float | None = None,
                 fast: FastModel | None = None):
        """An engine over a loaded model; `options` must name the model's device type and dtype.
        temperature: given, it replaces the options' (and their calibration's), checked by them.
        fast: a `fast.model.FastModel` already built from `model` with these options (engines over
        one model may share it, and its compiled functions); built here when kernels="fast" and
        none is given."""
        if options.torch_device.type != model.device.type or model.dtype != DTYPES[options.dtype]:
            raise ValueError(f"options ask for {options.dtype} on {options.device}, the model is {model.dtype} on {model.device}")
        if temperature is not None:
            options = dataclasses.replace(options, temperature=temperature, calibration=None)
        self.model = model
        self.compiler = compiler
        self.options = options
        self.model_id = model.manifest.data.get("model_id", "valen-preview-0923")
        self.fast = None
        self.text, self.vision = model.text, model.vision
        self.kernels = {"gated_delta": "torch", "attention": "eager"}
        if options.kernels == "fast":
            from .fast.model import FastModel

            if fast is None:
                fast = FastModel.build(model, options)
            elif (fast.compiled, fast.text.delta_impl, fast.vision.patch_gemm) != (options.compile, options.delta_kernel, options.patch_embed == "linear") \
                    or fast.text.embed_tokens is not model.text.embed_tokens:
                raise ValueError(f"the fast model given was not built from this model with compile={options.compile}, "
                                 f"delta_kernel={options.delta_kernel!r}, patch_embed={options.patch_embed!r}")
            self.fast = fast
            self.text, self.vision, self.kernels = self.fast.text, self.fast.vision, self.fast.kernels
        self.graphs = None
        if options.graphs:
            from .fast.graphs import GraphCache

            self.graphs = GraphCache()

    @classmethod
    def load(cls, export_dir: str | Path, options: EngineOptions | None = None, *, verify: str = "size",
             temperature: float | None = None) -> "Engine":
        """Load an export; options default to `EngineOptions()` (the device's defaults).
        verify: "size" checks file sizes, "full" re-hashes every file, "none" neither.
        temperature: given, it replaces the options' (see __init__)."""
        options = options if options is not None else EngineOptions()
        model = load_model(export_dir, device=options.device, dtype=options.dtype, verify=verify)
        prompt = model.manifest.data["prompt"]
        compiler = Compiler.from_dir(model.manifest.root, max_length=prompt["max_length"], media_kwargs=prompt.get("media_kwargs") or {})
        return cls(model, compiler, options, temperature=temperature)

    @property
    def mode(self) -> str:
        return self.options.mode

    @property
    def temperature(self) -> float:
        return self.options.temperature

    @property
    def one_pass(self) -> bool:
        """Whether a state with a chunk-aligned prefix runs the one-pass layout (else batch)."""
        return self.options.layout == one_pass.name

    @property
    def batches(self) -> bool:
        """Whether run_many sweeps several requests' rows through the layers together (the fast
        model's one-pass layout, shared-prefix mode); otherwise it runs them one after the other."""
        return self.options.batching

    def warming_up(self):
        """A context in which every CUDA graph key is captured on its first use: a server's warmup
        runs shapes chosen because clients reuse them (an image size's tower and plan, a batch's
        combined plan), so none of them waits for a client's request to recur."""
        return self.graphs.capturing_first_uses() if self.graphs is not None else contextlib.nullcontext()

    # ---- whole requests ---------------------------------------------------------------------

    def run(self, request: dict) -> RunResult:
        t0 = time.perf_counter()
        compiled, features = self.prepare(request)
        # prepare_s: request parsing, image decoding and tokenization (plus queuing the vision tower);
        # model_s: the rest of the device work, until the logits are ready.
        return self._execute_and_finish(compiled, features, {"prepare_s": time.perf_counter() - t0})

    def _execute_and_finish(self, compiled: CompiledRequest, features: torch.Tensor | None, timings: dict) -> RunResult:
        """The device work of one prepared request, awaited, then its answers; timings gains model_s."""
        t0 = time.perf_counter()
        outputs = self.queue_outputs(compiled, self.execute(compiled, features)).cpu()  # waits for the device
        return self.finish(compiled, outputs, {**timings, "model_s": time.perf_counter() - t0})

    def run_many(self, requests: list[dict]) -> list[RunResult | Exception]:
        """Several requests at once: each prepared alone, then those that compiled run in one sweep
        of the layers where the engine batches (`batches`), else one after the other. Per request:
        its RunResult, or the exception that request raised (a bad request fails alone).
        `prepare_many` -> `launch` -> `collect`, which a server can overlap (serve/admission.py)."""
        return self.collect(self.launch(self.prepare_many(requests)))

    def prepare_many(self, requests: list[dict], between: Callable[[], None] | None = None) -> "Batch":
        """The host work of run_many: every request compiled (its vision tower queued), a request
        that fails keeping its exception, and in shared-prefix mode the plan as it will run (one
        request's, or the combined plan where the engine batches), its tensors built.
        between: called before each request's host work and before the plan's (valen-serve
        answers the batch in flight there once `device_done`)."""
        t0 = time.perf_counter()
        prepared: list[tuple[CompiledRequest, torch.Tensor | None] | Exception] = []
        hook_s = 0.0  # time spent in `between` (another batch's work): not this batch's prepare_s

        def call_between() -> None:
            nonlocal hook_s
            if between is not None:
                started = time.perf_counter()
                between()
                hook_s += time.perf_counter() - started

        for request in requests:
            call_between()
            try:
                compiled, features = self.prepare(request)
            except Exception as exc:  # its own answer (4xx for a RequestError); the others go on
                prepared.append(exc)
                continue
            if features is not None and self.graphs is not None and len(requests) > 1:
                # A graphed tower answers in its graph's own buffer, which the next image of the same
                # grid overwrites: in a batch each request keeps a copy (queued in order, so it is
                # this one's). Alone, its text work is queued before any later tower replays.
                features = features.clone()
            prepared.append((compiled, features))
        call_between()
        ready = [p[0] for p in prepared if not isinstance(p, Exception)]
        plan = None
        if self.mode == "shared-prefix" and (len(ready) == 1 or (len(ready) > 1 and self.batches)):
            # The plan, fitted to a captured graph and its tensors built, here: on CUDA this host work
            # overlaps the device work of the batch before (the graphs captured so far are current,
            # as that batch was launched before this one is prepared).
            try:
                own = self.plan(ready[0]) if len(ready) == 1 else one_pass.build(ready, self.model.config)
                plan = self.served_plan(ready, own)
            except Exception as exc:  # raised again in launch; a batch's requests then each run alone
                plan = exc
        return Batch(prepared, plan, {"prepare_s": time.perf_counter() - t0 - hook_s})

    @torch.no_grad()
    def launch(self, batch: "Batch") -> "Batch":
        """Queue the device work of a prepared batch (not awaited on CUDA; `collect` waits)."""
        t0 = time.perf_counter()
        ready = batch.ready
        if self.graphs is not None:
            self.graphs.last_run = None
        try:
            if isinstance(batch.plan, Plan):
                logits = self.execute_plan_many([c for c, _ in ready], batch.plan, [f for _, f in ready])
            elif batch.plan is None:
                logits = [self.execute(c, f) for c, f in ready]
            else:
                raise batch.plan
            batch.outputs = self._copy_to_host([self.queue_outputs(c, lg) for (c, _), lg in zip(ready, logits)])
        except Exception as exc:
            batch.error = exc
        batch.timings["launch_s"] = time.perf_counter() - t0
        if batch.error is None and batch.outputs and self.model.device.type == "cuda":
            # (No event for a batch whose every request failed: nothing of it to wait for.)
            # After its device work and the copy of its outputs: collect waits for this event alone, not
            # for what was queued since (the next batch's vision towers, while valen-serve prepares it).
            batch.done = torch.cuda.Event()
            batch.done.record(torch.cuda.current_stream(self.model.device))
        if self.graphs is not None and self.graphs.last_run is not None:
            # how the text stack ran: "replay", "capture" or "direct" (a batch of one's own plan, or the last request's)
            batch.timings["graph"] = self.graphs.last_run
        return batch

    def device_done(self, batch: "Batch") -> bool:
        """Whether the device work a launch queued has finished (true on the CPU, where launching
        runs it, and for a batch whose launch failed)."""
        return batch.done is None or batch.done.query()

    def collect(self, batch: "Batch") -> list[RunResult | Exception]:
        """Wait for a launched batch and finish each request: per request its RunResult or exception."""
        t0 = time.perf_counter()
        if batch.error is not None:
            if len(batch.ready) < 2 or isinstance(batch.error, Cancelled):  # given up: nothing reruns
                return [p if isinstance(p, Exception) else batch.error for p in batch.prepared]
            # A failure of the combined sweep must not fail every request: each runs alone, and
            # one that fails again carries its own exception.
            return [p if isinstance(p, Exception) else self._run_prepared(*p) for p in batch.prepared]
        if batch.done is not None:
            batch.done.synchronize()
        # prepare_s: host work of the whole batch (parsing, decoding, tokenizing, the plan);
        # model_s: queuing its device work and waiting for it; batch: requests in the sweep;
        # graph (with CUDA graphs): whether its plan replayed a graph, captured one or ran directly.
        timings = {"prepare_s": batch.timings["prepare_s"], "model_s": batch.timings["launch_s"] + time.perf_counter() - t0,
                   "batch": len(batch.ready) if isinstance(batch.plan, Plan) else 1}
        if "graph" in batch.timings:
            timings["graph"] = batch.timings["graph"]
        out, outputs = [], iter(batch.outputs)
        for p in batch.prepared:
            out.append(p if isinstance(p, Exception) else self._finish_or_error(p[0], next(outputs), dict(timings)))
        return out

    def _finish_or_error(self, compiled: CompiledRequest, outputs: torch.Tensor, timings: dict) -> RunResult | Exception:
        try:
            return self.finish(compiled, outputs, timings)
        except Exception as exc:  # that request's answer (non-finite logits); its batch-mates go on
            return exc

    def _copy_to_host(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device tensors queued into one host tensor (pinned on CUDA, non-blocking: read it after an
        event recorded behind the copy), returned as views in the same sizes."""
        if not outputs:  # every request of the batch failed to compile
            return []
        values = torch.cat(outputs)
        if values.device.type != "cpu":
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            values = host.copy_(values, non_blocking=True)
        return list(values.split([o.numel() for o in outputs]))

    def _run_prepared(self, compiled: CompiledRequest, features: torch.Tensor | None) -> RunResult | Exception:
        try:
            return self._execute_and_finish(compiled, features, {"batch": 1})
        except Exception as exc:
            return exc

    def answer(self, request: dict) -> dict:
        return self.run(request).response

    # ---- prepare ----------------------------------------------------------------------------

    def prepare(self, request: dict) -> tuple[CompiledRequest, torch.Tensor | None]:
        """The compiled request and the vision tower's output (None for text states), the tower
        queued from inside the compile as soon as the images are decoded (same stream: on CUDA it
        runs while the host tokenizes, nothing waits)."""
        started: list[torch.Tensor] = []
        compiled = self.compiler.compile(request, lambda images: started.append(self.vision_features(images)))
        return compiled, (started[0] if started else None)

    @torch.no_grad()
    def vision_features(self, images: ImageInputs | VideoInputs) -> torch.Tensor:
        """The vision tower's output [n_visual_tokens, H] for a state's images or its video
        (queued on the device, not awaited)."""
        pixel_values = images.pixel_values_on(self.model.device)  # uint8 uploaded, patches made on the device
        if self.graphs is None:
            return self.vision(pixel_values, images.grid_thw)
        # Graphed per grid combination (a video's grid, t frame pairs, is one more such key). The
        # grid tables (weights only) are built when the graph is captured; the graph cache keeps
        # the closure, so they live as long as the graph.
        grids = grid_list(images.grid_thw)
        key = vision_graph_key(images.grid_thw)
        tables = None if key in self.graphs else self.vision.grid_tables(grids)
        lengths = frame_lengths(grids)
        # Only this image size reuses the graph: captured on the size's second use, not its first.
        (features,) = self.graphs.run(key, lambda px: (self.vision.encode(px, *tables, lengths),), pixel_values,
                                      capture_on_first_use=False)
        return features

    # ---- execute ----------------------------------------------------------------------------

    @torch.no_grad()
    def execute(self, compiled: CompiledRequest, features: torch.Tensor | None) -> list[torch.Tensor]:
        """Per-question logits [K] fp32 given the vision tower's output (None for text-only states)."""
        if self.mode == "shared-prefix":
            return self.execute_plan(compiled, self.plan(compiled), features)
        return [torch.cat([self._branch_logits(compiled, br, features) for br in q.branches]) for q in compiled.questions]

    def plan(self, compiled: CompiledRequest) -> Plan:
        """The request's shared-prefix plan, its layout chosen by `layouts.choose` under `options.layout`."""
        return choose(compiled, self.model.config, self.options.layout)

    def _branch_logits(self, compiled: CompiledRequest, br, features) -> torch.Tensor:
        """Per-branch mode: one forward of state + suffix from position 0 (batch 1), then the head."""
        hidden = self.branch_hidden(compiled, br, features)
        return self.model.head.logits(hidden[br.candidate_positions], hidden[br.decision_position])

    def branch_hidden(self, compiled: CompiledRequest, br, features) -> torch.Tensor:
        """The text stack's last hidden states [T, H] of one branch (state + suffix, batch 1): what
        the reference's language model returns for it (the head reads rows of it)."""
        m, st = self.model, compiled.state
        ids = st.input_ids + br.suffix_ids
        types = st.mm_token_type_ids + [0] * len(br.suffix_ids)
        positions, _ = rope_index(ids, types, st.image_grid_thw, m.config.vision_config.spatial_merge_size,
                                  video_grid_thw=st.video_grid_thw)  # [3, T]
        embeds = self.text.embed(torch.tensor([ids], device=m.device))  # [1, T, H]
        if features is not None:
            # As HF: image (video) features replace the <|image_pad|> (<|video_pad|>) embeddings in
            # order, no host sync. A state holds images or one video, never both (wire.py).
            visual_mask = (torch.tensor(types) != 0).to(m.device)
            embeds = embeds.masked_scatter(visual_mask.view(1, -1, 1), features.to(embeds.dtype))
        return self.text(embeds, positions[:, None, :].to(m.device))[0]  # [T, H]

    def served_plan(self, compiled: list[CompiledRequest], plan: Plan) -> Plan:
        """The plan that runs `plan`'s requests, its tensors built: with CUDA graphs, `plan` padded into
        a captured shape that holds it, else with headroom (`layouts.graph_plan`); else `plan`."""
        if self.graphs is not None:
            plan = graph_plan(compiled, self.model.config, plan, self.graphs.keys())
        plan.inputs  # built once, for the shape it runs in
        return plan

    @torch.no_grad()
    def execute_plan(self, compiled: CompiledRequest, plan: Plan, features: torch.Tensor | None) -> list[torch.Tensor]:
        """Shared-prefix mode on a given plan (fitted to the graphs by `served_plan`): per-question logits [K] fp32."""
        return self.execute_plan_many([compiled], self.served_plan([compiled], plan), [features])[0]

    @torch.no_grad()
    def execute_plan_many(self, compiled: list[CompiledRequest], plan: Plan,
                          features: list[torch.Tensor | None]) -> list[list[torch.Tensor]]:
        """A plan as it runs (`served_plan`) over one or several requests (in plan order): per
        request, per-question logits [K] fp32."""
        inputs = plan.upload(self.model.device)  # one host-to-device copy of every index the requests need
        images = [f for f in features if f is not None]  # in request order, as the plan's image indices
        if images:
            inputs = inputs._replace(features=images[0] if len(images) == 1 else torch.cat(images))
        forward = functools.partial(LAYOUTS[plan.kind].forward, self.text, self.model.head, plan.shape)
        if self.graphs is None:
            (logits,) = forward(inputs)
        else:
            # A plan is reused by its padded neighbours (a batch's by batches of the same prefixes and
            # image tokens, in any order), so its first use captures; but a plan with image or video
            # tokens only once those sizes recur (their vision graphs are captured).
            visual = [v for v in (c.state.vision_inputs for c in compiled) if v is not None]
            first_use_captures = all(vision_graph_key(v.grid_thw) in self.graphs for v in visual)
            (logits,) = self.graphs.run(plan.key, forward, inputs, capture_on_first_use=first_use_captures)
        # [K_b] per branch of every request; a bucketed plan's pad candidates follow the real ones.
        per_branch = iter(logits[: sum(plan.candidates_per_branch)].split(plan.candidates_per_branch))
        out = []
        for c in compiled:
            out.append([torch.cat([next(per_branch) for _ in q.branches]) for q in c.questions])
        return out

    # ---- finish -----------------------------------------------------------------------------

    def queue_outputs(self, compiled: CompiledRequest, logits: list[torch.Tensor]) -> torch.Tensor:
        """A request's per-question logits [K] then their softmax at the engine's temperature, one fp32
        tensor on the logits' device (queued, not awaited); `finish` reads its host copy."""
        return queue_probabilities(logits, [len(q.keys) for q in compiled.questions], self.temperature)

    def finish(self, compiled: CompiledRequest, outputs: torch.Tensor, timings: dict) -> RunResult:
        """Answers and the response JSON from `queue_outputs`' tensor copied to the host."""
        probs, host_logits = read_probabilities(outputs, [len(q.keys) for q in compiled.questions])
        answers = {
            q.qid: answer_from_probabilities(q.kind, q.keys, q.descriptions, p) for q, p in zip(compiled.questions, probs)
        }
        return RunResult(response(compiled, answers, model_id=self.model_id), compiled, host_logits, timings)
