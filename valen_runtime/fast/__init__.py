"""The CUDA fast path: a second implementation of Valen's text stack and vision tower, built from
the reference modules' loaded weights and tested against them (tests/valen_runtime/fast/).

- kernels.py: flash-linear-attention's gated delta rule, SDPA, the delta rule as custom ops;
- projections.py: projections of one input as one GEMM, FP32 LoRA adapters grouped;
- layers.py: every decoder layer as one function of tensors, compiled once for all layers;
- model.py: `FastModel` (`FastText` with the one-pass layout, `FastVision`);
- graphs.py: CUDA-graph capture and replay.

Submodules are imported where they are used, so importing the package registers nothing.
"""
