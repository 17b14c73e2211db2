"""A model package on disk: manifest, blobs, stage graphs and the tokenizer.

``stage_graph`` merges the unit graphs of a range ``[start, end)`` into one ONNX graph (unit
boundaries become internal tensors) and stores it as a blob too, so a worker receives one
graph and the weight files it references, all named by hash.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import onnx
from onnx import helper

from .graphs import IR_VERSION, MS, OPSET, gpu_form, pad_lone_rows, sampler_form, verify_form
from .manifest import Manifest, sha256_bytes, verify_blob
from .tokenizer import TextTokenizer


class Package:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        path = self.root / "manifest.json"
        if not path.is_file():
            raise FileNotFoundError(f"{self.root}: not a model package (no manifest.json)")
        self.manifest = Manifest.from_json(path.read_text())
        self.stored_context = self.manifest.max_context  # what the package holds (its rope tables)
        self.blobs = self.root / "blobs"
        self._stage_shas: dict[tuple, str] = {}  # merging is slow; the result never changes
        self._context: int | None = None  # limit_context's, kept across reload

    @property
    def name(self) -> str:
        return self.manifest.name

    def blob(self, sha: str) -> Path:
        return self.blobs / sha

    def verify(self, shas) -> None:
        """Raise ``HashMismatch`` (or FileNotFoundError) for the first bad or missing blob."""
        for sha in shas:
            path = self.blob(sha)
            if not path.is_file():
                raise FileNotFoundError(f"{self.name}: blob {sha[:16]}… is missing")
            verify_blob(path, sha)

    def stage_graph(self, start: int, end: int, precision: str | None = None, batch_invariant: bool = False, gpu: bool = False,
                    verify: bool = False, sampler: bool = False) -> str:
        """sha256 of the merged graph for units ``[start, end)`` (built once, then cached);
        ``batch_invariant``: its form that runs a lone row's 4-bit products on two rows
        (``graphs.pad_lone_rows``), for ``serve --batch-invariant``; ``gpu``: its form for a GPU
        stage (``graphs.gpu_form``; batch invariance is a CPU kernel's property, not asked there);
        ``verify``: its form for speculative decoding (``graphs.verify_form``: attention on two query
        positions at least, 4-bit products on two rows at least, a head that runs at chosen
        positions), batch-invariant too; ``sampler``: a head that also returns its sampler's
        distribution (``graphs.sampler_form``; the verify form does)."""
        m = self.manifest
        if not 0 <= start < end <= len(m.units):
            raise ValueError(f"unit range [{start}, {end}) is outside the model's {len(m.units)} units")
        sampler = sampler and not verify and end == len(m.units)
        if end - start == 1 and not batch_invariant and not gpu and not verify and not sampler:
            return m.variant(start, precision).graph
        if verify and gpu:
            raise ValueError("speculative decoding's verify form is CPU-only (its exactness is the CPU kernels')")
        batch_invariant = batch_invariant and not gpu and not verify
        key = (start, end, precision or m.precision, m.variant(start, precision).graph, batch_invariant, gpu, verify, sampler)
        if key in self._stage_shas:
            return self._stage_shas[key]
        if sampler:
            model = sampler_form(onnx.load(self.blob(self.stage_graph(start, end, precision, batch_invariant, gpu)), load_external_data=False))
        elif verify:
            model = verify_form(onnx.load(self.blob(self.stage_graph(start, end, precision)), load_external_data=False))
        elif gpu:
            model = gpu_form(onnx.load(self.blob(self.stage_graph(start, end, precision)), load_external_data=False))
        elif batch_invariant:
            plain = self.stage_graph(start, end, precision)
            model = pad_lone_rows(onnx.load(self.blob(plain), load_external_data=False))
        else:
            units = [onnx.load(self.blob(m.variant(u, precision).graph), load_external_data=False) for u in range(start, end)]
            model = merge_units(units, f"{m.name}[{start}:{end})")
        data = model.SerializeToString()
        sha = sha256_bytes(data)
        if not self.blob(sha).exists():
            tmp = self.blob(sha).with_suffix(".tmp")
            tmp.write_bytes(data)
            tmp.replace(self.blob(sha))
        self._stage_shas[key] = sha
        return sha

    def runner(self, start: int, end: int, precision: str | None = None, threads: int | None = None, verify: bool = True,
               spin: bool = False, batch_invariant: bool = False, device=None, verify_form: bool = False, sampler: bool = False):
        """A StageRunner over units ``[start, end)``, its weight files checked against their hashes;
        ``device`` (``runtime.devices``): where it computes, a GPU with the graph's GPU form;
        ``verify_form``: the graph's form for speculative decoding (``graphs.verify_form``);
        ``sampler``: a head that returns its sampler's distribution (``graphs.sampler_form``: a draft model's)."""
        from ..runtime.stage_runner import StageRunner

        if verify:
            self.verify(self.manifest.stage_files(start, end, precision))
        gpu = device is not None and device.is_gpu
        return StageRunner(self.blob(self.stage_graph(start, end, precision, batch_invariant, gpu, verify_form, sampler)), threads=threads,
                           max_context=self.manifest.max_context, spin=spin, device=device)

    def pipeline(self, cuts: list[int] | tuple[int, ...] = (), precision: str | None = None, threads: int | None = None,
                 precisions: list[str | None] | None = None, batch_invariant: bool = False, devices: list | None = None,
                 verify_form: bool = False):
        """A LocalPipeline cut before each unit index in ``cuts``; ``precisions`` picks a
        variant per stage (the reference for a pipeline that mixes native and browser workers);
        ``batch_invariant``: the graphs of a cluster served with ``--batch-invariant`` (``graphs.pad_lone_rows``);
        ``devices``: where each stage computes (``runtime.devices``; default the CPU), the
        single-process reference of a cluster that mixes CPU and GPU workers; ``verify_form``: the
        graphs of a cluster that decodes speculatively (``graphs.verify_form``)."""
        from ..runtime.local import LocalPipeline
        from ..runtime.stage_runner import spin_by_default

        bounds = [0, *sorted(cuts), len(self.manifest.units)]
        per_stage = precisions or [precision] * (len(bounds) - 1)
        spin = len(bounds) == 2 and spin_by_default(threads)  # several sessions in one process: one spinning would slow the next
        per_device = devices or [None] * (len(bounds) - 1)
        return LocalPipeline([self.runner(a, b, p, threads, spin=spin, batch_invariant=batch_invariant, device=d, verify_form=verify_form)
                              for (a, b), p, d in zip(zip(bounds, bounds[1:]), per_stage, per_device)])

    def reload(self) -> None:
        """Re-read the manifest (after a variant was added)."""
        self.manifest = Manifest.from_json((self.root / "manifest.json").read_text())
        self.stored_context = self.manifest.max_context
        if self._context is not None:
            self.limit_context(self._context)

    def limit_context(self, tokens: int) -> None:
        """Serve sequences of at most ``tokens`` positions (``serve --context``): the manifest this
        process reads says so, so the API, the coordinator and every stage's load use it. It
        cannot exceed what the package holds (``stored_context``: re-import for more)."""
        import dataclasses

        if not 1 <= tokens <= self.stored_context:
            raise ValueError(f"context {tokens} is outside [1, {self.stored_context}], what the package {self.name} holds")
        self._context = tokens
        self.manifest = dataclasses.replace(self.manifest, max_context=tokens)

    @cached_property
    def tokenizer(self) -> TextTokenizer:
        m = self.manifest
        return TextTokenizer.from_json(self.blob(m.tokenizer).read_text(), m.chat_template, m.eos_ids, m.bos_id, m.add_bos)


def merge_units(units: list[onnx.ModelProto], name: str) -> onnx.ModelProto:
    """Chain unit graphs: each unit's ``hidden.k`` output feeds the next unit's input."""
    nodes, inits, inputs, outputs = [], {}, {}, []
    produced: set[str] = set()
    for model in units:
        g = model.graph
        nodes.extend(g.node)
        for t in g.initializer:
            inits.setdefault(t.name, t)
        for i in g.input:
            if i.name not in produced and i.name not in inputs:
                inputs[i.name] = i
        produced.update(o.name for o in g.output)
    last = units[-1].graph.output
    outputs = [o for o in last if not o.name.startswith("present_")]
    outputs += [o for model in units for o in model.graph.output if o.name.startswith("present_")]
    graph = helper.make_graph(nodes, name, list(inputs.values()), outputs, list(inits.values()))
    model = helper.make_model(graph, ir_version=IR_VERSION, producer_name="edgepipe",
                              opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)])
    known = {o.domain for o in model.opset_import}
    for extra in {(o.domain, o.version) for m in units for o in m.opset_import if o.domain not in known}:
        model.opset_import.append(helper.make_opsetid(*extra))  # e.g. edgepipe.gguf, the kernel library's ops
    props = [{p.key: p.value for p in m.metadata_props} for m in units]  # what every unit says, the stage says
    helper.set_model_props(model, {k: v for k, v in props[0].items() if all(d.get(k) == v for d in props[1:])})
    return model
