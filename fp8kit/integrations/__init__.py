"""fp8kit with other libraries (docs/integrations.md). Each submodule imports its library when it is imported:

- `fp8kit.integrations.hf_conv1d`: Hugging Face's `Conv1D` (GPT-2) with FP8 GEMMs; importing it registers the
  layer with `convert_model`.
- `fp8kit.integrations.transformers`: load a `save_pretrained` directory into a converted model, FP8 state included.
- `fp8kit.integrations.accelerate`: FP8 for Hugging Face `accelerate` and `Trainer`, as accelerate does with
  Transformer Engine.
- `fp8kit.integrations.lightning`: a Lightning precision plugin, as Lightning's Transformer Engine one.
"""
