"""The names the served model answers to in a request's ``model`` field (every API alike).

A user names a model as they met it: the package name (``edgepipe models``, ``/v1/models``), the
same with Ollama's tag (``/api/tags``: ``name:latest``), the alias it was imported under
(``qwen05``), or the file it came from (``qwen2.5-coder-0.5b-instruct`` after importing
``qwen2.5-coder-0.5b-instruct.gguf``, with or without the precision suffix). These are compared as
``importer.package_name`` writes a name (lower case, runs of other characters as ``-``), so a
file stem and the package named after it meet. Ollama matches ``name[:tag]`` with a missing tag
read as ``latest``: the only tag served is ``latest``. llama-server ignores the field; a name that
is none of these is refused here (404 ``model_not_found``, listing what is served) so that a client
pointed at the wrong server learns it at once rather than getting another model's answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePath


def normal(name: str) -> str:
    """A name as ``importer.package_name`` writes one: lower case, other runs as ``-``."""
    return re.sub(r"[^a-z0-9_]+", "-", name.lower()).strip("-")


@dataclass(frozen=True)
class ServedNames:
    shown: tuple[str, ...]  # what errors list and responses name: the package name first, then the alias
    accepted: frozenset[str]  # normalised forms a request may use

    @classmethod
    def of(cls, package_name: str, alias: str | None = None, source_path: str | None = None) -> ServedNames:
        from ..model.store import stem  # the package name without its precision suffix

        shown = (package_name, alias) if alias else (package_name,)
        forms = {package_name, stem(package_name), *(shown[1:])}
        if source_path:
            forms.add(PurePath(source_path).stem if PurePath(source_path).suffix.lower() == ".gguf" else PurePath(source_path).name)
        return cls(shown, frozenset(normal(f) for f in forms if f))

    def answers(self, model: str) -> bool:
        """Whether ``model`` names the served model (a ``:latest`` tag is Ollama's default one)."""
        name, _, tag = model.partition(":")
        return (not tag or tag == "latest") and bool(name) and normal(name) in self.accepted

    def listing(self) -> str:
        return ", ".join(self.shown)
