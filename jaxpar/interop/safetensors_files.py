"""The files of a Hugging Face model directory: safetensors weights (one file, or shards listed by
`model.safetensors.index.json`) read lazily and written in shards, and the other files jaxpar reads from such a
directory, each held to it.

**Weight dtypes.** Each tensor's dtype is read from its safetensors header before its data, and import accepts the
floating-point kinds that hold ordinary weights: F32, F16, BF16 and F64, each converted (rounded to nearest) to the
run's param dtype, float32, bfloat16 or float16 — as `from_pretrained(torch_dtype=...)` does. F64 is accepted because
a float64 save (of a `.double()` model) holds the same weights at more precision than any of jaxpar's dtypes can
keep. FP8 and the other sub-16-bit floats (F8_E4M3, F8_E5M2, F8_E8M0, F6_*, F4) are refused: they appear in
quantized checkpoints whose per-block scales are separate tensors, and reading the raw values without them gives
garbage. Integer, bool and complex tensors are refused too: no weight of these architectures is one, so the file is
someone else's or damaged.

**Trust.** A model directory is data from the internet. Only JSON and safetensors are parsed (config.json's keys
are type-checked, and its sizes checked against these headers before any array is built, by `jaxpar.interop.hf`),
and every file read or copied — config.json, tokenizer.json, tokenizer_config.json,
special_tokens_map.json, generation_config.json, the index, the weights — must be a regular file that resolves, links
followed, inside the directory: `../x.safetensors`, an absolute path or a link out in `model.safetensors.index.json`,
a tokenizer.json linked to /etc/hostname, are refused. One exception keeps the hub cache loadable: in
`<repo>/snapshots/<revision>/` the files may be links into `<repo>/blobs/`, which is how `huggingface_hub` stores
them.

Every problem is an `HFError` (a `JaxparError`: the CLI prints it as one line and exits 2) naming the file and, where
there is one, the tensor. The mapping between these tensors and jaxpar's parameters is `jaxpar.interop.hf`'s.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Iterable

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxpar.errors import JaxparError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HFError(JaxparError, ValueError):
    """A Hugging Face directory that cannot be imported, with the file (and tensor) at fault and what to do."""

    kind = "Hugging Face error"


# Weight dtypes (the safetensors header's names) that import converts to the run's param dtype, and why the others
# are refused; see the module docstring.
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def model_dir(path: str | pathlib.Path) -> pathlib.Path:
    """`path` as a directory, or an HFError saying it does not exist or is a file."""
    path = pathlib.Path(path)
    if not path.exists():
        raise HFError(f"{path}: no such directory; pass a Hugging Face model directory (config.json + *.safetensors)")
    if not path.is_dir():
        raise HFError(f"{path}: a file, not a directory; pass the Hugging Face model directory that holds "
                      "config.json and the *.safetensors weights")
    return path


def inside(path: pathlib.Path, file: pathlib.Path) -> bool:
    """True when weight file `file`, with every link followed, lies inside model directory `path` — or, for a
    snapshot of the Hugging Face hub cache (`<repo>/snapshots/<revision>/`, whose files are links to
    `<repo>/blobs/<sha256>`), inside that repository's blobs."""
    root, target = path.resolve(), file.resolve()
    allowed = [root]
    if root.parent.name == "snapshots":
        allowed.append(root.parent.parent / "blobs")
    return any(target.is_relative_to(r) for r in allowed)


# Every file jaxpar reads or copies from a model directory besides the weights (which SafetensorsDir checks itself).
MEMBERS = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
           "generation_config.json", INDEX)


def member(path: pathlib.Path, name: str) -> pathlib.Path | None:
    """File `name` of model directory `path`, or None when there is none; an HFError when it resolves (links
    followed) outside the directory (`inside`) or is not a regular file — a link to /etc/hostname or /dev/zero is
    refused, never read or copied."""
    file = path / name
    if not os.path.lexists(file):
        return None
    if not inside(path, file):
        raise HFError(f"{file}: resolves to {file.resolve()}, outside {path}; jaxpar reads only files inside the "
                      "model directory — copy the file in")
    if not file.is_file():
        raise HFError(f"{file}: not a regular file (a directory, device or broken link); replace it with the "
                      "model's file")
    return file


def check_members(path: pathlib.Path) -> None:
    """Hold every file of MEMBERS that `path` has to the directory (`member`), before any of them is used."""
    for name in MEMBERS:
        member(path, name)


def _check_dtype(file: pathlib.Path, name: str, dtype: str) -> None:
    """Raise an HFError unless safetensors dtype `dtype` (e.g. 'F32', 'I32') is one import reads as a weight."""
    if dtype in FLOAT_DTYPES:
        return
    if dtype.startswith("F"):  # F8_E4M3, F8_E5M2, F8_E8M0, F6_*, F4: quantized formats
        why = ("a quantized low-precision float, whose scales are separate tensors that jaxpar does not apply; use "
               "the model's bfloat16/float16/float32 release, or dequantize it first")
    else:  # I*, U*, BOOL, C64: not weights of these architectures
        why = ("not a floating-point weight: the file is not this model's checkpoint, or its header is damaged; "
               "re-download or re-save it")
    raise HFError(f"{file}: tensor {name!r} has dtype {dtype}; jaxpar imports weights stored as "
                  f"{', '.join(FLOAT_DTYPES)} — {why}")


class SafetensorsDir:
    """The tensors of a Hugging Face directory by name, across shards, read lazily (memory-mapped) one at a time.

    Only files that resolve inside the directory are opened (see `inside`): a `model.safetensors.index.json` is
    data from the internet, and its weight_map could otherwise name `../../x`, `/dev/zero` or a link out."""

    def __init__(self, path: pathlib.Path):
        self.path = path = model_dir(path)
        if member(path, INDEX) is not None:
            weight_map = self._read_index(path / INDEX)
        elif (path / SINGLE).is_file():
            weight_map = None
        else:
            pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
            hint = (f" (found {pickles}: jaxpar never loads pickles — re-save with "
                    "`model.save_pretrained(dir, safe_serialization=True)`)" if pickles else "")
            raise HFError(f"{path}: no {SINGLE} or {INDEX}{hint}")
        self._files: dict[str, Any] = {}
        if weight_map is None:
            self._checkinside(SINGLE, f"{path / SINGLE}:")
            self.where = {name: SINGLE for name in self._open(SINGLE).keys()}
        else:
            self.where = weight_map
            for file in sorted(set(self.where.values())):
                listed = {n for n, f in self.where.items() if f == file}
                self._checkinside(file, f"{path / INDEX}: weight_map entry {min(listed)!r} names {file!r}, which")
                present = set(self._open(file).keys())
                if listed - present:
                    raise HFError(f"{path / file}: tensor {sorted(listed - present)[0]!r} is listed in {INDEX} but "
                                  "missing from the file; the download is incomplete")

    @staticmethod
    def _read_index(file: pathlib.Path) -> dict[str, str]:
        """The index's weight_map (tensor name → file name), checked to be one."""
        try:
            index = json.loads(file.read_text())
        except (ValueError, OSError) as e:
            raise HFError(f"{file}: not a safetensors index ({e}); re-save the model") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise HFError(f"{file}: not a safetensors index (it needs a 'weight_map' object of tensor name → file "
                          "name); re-save the model")
        return dict(weight_map)

    def _checkinside(self, file: str, entry: str) -> None:
        """Refuse weight file `file` unless it is a regular file inside the directory (`entry`: who named it)."""
        where = self.path / file
        if not inside(self.path, where):
            raise HFError(f"{entry} resolves to {where.resolve()}, outside {self.path}; jaxpar reads weights only "
                          "from files inside the model directory")
        if where.exists() and not where.is_file():
            raise HFError(f"{entry} is not a regular file; a weight file must be a .safetensors file in {self.path}")

    def _open(self, file: str):
        if file not in self._files:
            try:
                self._files[file] = safe_open(str(self.path / file), framework="numpy")
            except FileNotFoundError:
                raise HFError(f"{self.path / file}: file not found (listed in {INDEX}); the download is incomplete") \
                    from None
            except (SafetensorError, OSError) as e:
                raise HFError(f"{self.path / file}: damaged safetensors file ({e}); re-download or re-save it") \
                    from None
        return self._files[file]

    def names(self) -> set[str]:
        """Every tensor name in the checkpoint."""
        return set(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor `name`'s shape, from its file's header (no data is read)."""
        if name not in self.where:
            raise HFError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        file = self.where[name]
        try:
            return tuple(self._open(file).get_slice(name).get_shape())
        except (SafetensorError, OSError, TypeError) as e:
            raise HFError(f"{self.path / file}: tensor {name!r} could not be read ({e})") from None

    def get(self, name: str, shape: tuple[int, ...] | None = None, index: tuple | None = None) -> np.ndarray:
        """Tensor `name` as a NumPy array in its stored dtype, checked against `shape` when given and, from the
        header before any data is read, against FLOAT_DTYPES. `index` (basic indices: ints and slices) reads only
        that part of the tensor (`shape` is then the whole tensor's, checked from the header)."""
        if name not in self.where:
            raise HFError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        file = self.where[name]
        try:
            header = self._open(file).get_slice(name)
            _check_dtype(self.path / file, name, header.get_dtype())
            stored = tuple(header.get_shape())
            if shape is None or stored == tuple(shape):
                x = self._open(file).get_tensor(name) if index is None else header[index]
        except (SafetensorError, OSError, TypeError) as e:  # TypeError: a dtype NumPy cannot hold
            raise HFError(f"{self.path / file}: tensor {name!r} could not be read ({e})") from None
        if shape is not None and stored != tuple(shape):
            raise HFError(f"{self.path / file}: tensor {name!r} has shape {stored}, but config.json implies "
                          f"{tuple(shape)}")
        return x


def write_shards(tensors: Iterable[tuple[str, np.ndarray]], path: pathlib.Path, max_shard_bytes: int) -> None:
    """Write `tensors` (name, array) in order into `path` as safetensors: one `model.safetensors` when they fit in
    `max_shard_bytes`, else shards `model-0000i-of-0000n.safetensors` of at most that size (a tensor larger than it
    gets a shard of its own) and the index. Each file carries the metadata {"format": "pt"}, without which
    `transformers` refuses it."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, x in tensors:
        if shards[-1] and size + x.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = x
        size += x.nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / SINGLE), metadata=metadata)
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata=metadata)
        weight_map.update({n: file for n in shard})
        total += sum(x.nbytes for x in shard.values())
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
