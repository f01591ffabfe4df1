"""valen_runtime: a small PyTorch runtime for Valen-Preview-0923 over `valen-export` output.

It reads only the exported safetensors, config and tokenizer files; it never imports
transformers or peft and never unpickles anything.
"""
