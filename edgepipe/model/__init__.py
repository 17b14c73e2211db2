"""Model packages: import (GGUF / HF folder), per-unit ONNX graphs, manifest, tokenizer.

Workers import only ``manifest`` from here (standard library); everything else is for the
coordinator and the importer.
"""
