"""valen_export: Valen-Preview-0923 checkpoint.pt + Qwen3.5-2B base -> native-ready safetensors."""
