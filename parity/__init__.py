"""parity: the pinned reference (transformers 5.4.0 + peft 0.18.1) and the runtime-vs-reference harness."""
