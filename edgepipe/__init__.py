"""edgepipe: serve one LLM from a pool of unlike devices as a layer pipeline.

Data flows one way: profile -> plan -> deploy -> serve.

- ``edgepipe.model``   model packages: GGUF/HF import, per-unit ONNX graphs, tokenizer.
- ``edgepipe.runtime`` the stage runner (ONNX Runtime + numpy only) and local generation.
- ``edgepipe.plan``    the pure planner: profiles in, plan out.
- ``edgepipe.net``     wire protocol and transports.
- ``edgepipe.cluster`` coordinator and worker (asyncio shells around the above).
- ``edgepipe.api``     OpenAI-compatible HTTP API, dashboard, metrics.
- ``edgepipe.emulate`` labelled emulation of slow devices and links for testing.
"""

__version__ = "0.1.0"
PROTOCOL_VERSION = 1
