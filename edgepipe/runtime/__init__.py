"""Running units: the stage runner (ONNX Runtime + numpy only) and single-process generation."""
