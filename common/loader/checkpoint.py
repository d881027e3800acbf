"""A Hugging Face safetensors checkpoint on disk: which files, which tensors, and reading them, whole or in part
(never unpickling)."""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from omnirun.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
# A header bigger than this is not a real one (safetensors itself refuses headers over 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024


def _safetensors_dtypes() -> dict[str, torch.dtype]:
    """The safetensors dtype strings this torch build can represent."""
    names = {
        "F64": "float64",
        "F32": "float32",
        "F16": "float16",
        "BF16": "bfloat16",
        "I64": "int64",
        "I32": "int32",
        "I16": "int16",
        "I8": "int8",
        "U64": "uint64",
        "U32": "uint32",
        "U16": "uint16",
        "U8": "uint8",
        "BOOL": "bool",
        "C64": "complex64",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2": "float8_e5m2",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
        "F8_E8M0": "float8_e8m0fnu",
    }
    # Older torch builds lack some of these (unsigned ints, fp8 flavours): leave them out rather than fail.
    return {
        key: getattr(torch, name) for key, name in names.items() if isinstance(getattr(torch, name, None), torch.dtype)
    }


SAFETENSORS_DTYPES = _safetensors_dtypes()


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor's name, shape and dtype as its safetensors header declares them, and the file holding it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _one_line(exc: BaseException) -> str:
    """An exception's message folded onto one line, for our one-line errors."""
    return " ".join(str(exc).split())


def read_header(path: Path) -> dict[str, TensorSpec]:
    """Parse one safetensors file's header (8-byte little-endian length + JSON) without reading tensor data.

    Checks what `safe_open` would only trip over later: a garbled header, unknown dtypes, and data offsets that
    run past the end of the file (a truncated download) or disagree with the declared shape.
    """
    try:
        file_size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ModelLoadError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
                raise ModelLoadError(
                    f"{path} has a corrupt safetensors header (declared length {header_len} bytes, "
                    f"file is {file_size} bytes): re-download or re-save the checkpoint"
                )
            raw = f.read(header_len)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {_one_line(exc)}") from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(
            f"{path} has a corrupt safetensors header ({_one_line(exc)}): re-download or re-save the checkpoint"
        ) from exc
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path} has a corrupt safetensors header (not a JSON object): re-download it")

    data_size = file_size - 8 - header_len
    specs: dict[str, TensorSpec] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        specs[name] = _spec_from_entry(path, name, entry, data_size)
    return specs


def _spec_from_entry(path: Path, name: str, entry: object, data_size: int) -> TensorSpec:
    """One header entry -> TensorSpec, checked against the size of the file's data section."""
    try:
        dtype_str = entry["dtype"]  # type: ignore[index]
        shape = tuple(int(d) for d in entry["shape"])  # type: ignore[index]
        begin, end = (int(o) for o in entry["data_offsets"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError) as exc:
        raise ModelLoadError(
            f"{path} has a corrupt safetensors header entry for tensor '{name}': re-download or re-save the checkpoint"
        ) from exc
    dtype = SAFETENSORS_DTYPES.get(dtype_str)
    if dtype is None:
        raise ModelLoadError(
            f"{path}: tensor '{name}' has dtype {dtype_str!r}, which omnirun cannot load "
            f"(supported: {', '.join(SAFETENSORS_DTYPES)})"
        )
    if any(d < 0 for d in shape) or not 0 <= begin <= end:
        raise ModelLoadError(f"{path} has a corrupt safetensors header entry for tensor '{name}': re-download it")
    if end > data_size:
        raise ModelLoadError(
            f"{path} is truncated: tensor '{name}' ends at data byte {end} but the file holds only {data_size} "
            "data bytes; re-download or re-save the checkpoint"
        )
    spec = TensorSpec(name=name, shape=shape, dtype=dtype, file=path)
    if end - begin != spec.nbytes:
        raise ModelLoadError(
            f"{path} has a corrupt safetensors header: tensor '{name}' spans {end - begin} bytes but its shape "
            f"{list(shape)} and dtype {dtype_str} need {spec.nbytes}; re-download or re-save the checkpoint"
        )
    return spec


class SafetensorsCheckpoint:
    """The `*.safetensors` weights of a Hugging Face model directory, sharded (with an index file) or not."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ModelLoadError(f"model directory {self.directory} does not exist (or is not a directory)")
        # Set from the index file of a sharded checkpoint: tensor name -> shard file name.
        self._weight_map: dict[str, str] | None = None
        self._files = self._find_files()
        self._specs: dict[str, TensorSpec] | None = None

    def _find_files(self) -> list[Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            return self._files_from_index(index)
        files = sorted(p for p in self.directory.glob("*.safetensors") if p.is_file())
        if files:
            return files
        pickled = sorted(p.name for p in self.directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickled:
            raise ModelLoadError(
                f"{self.directory} holds only pickled weights ({', '.join(pickled)}) and omnirun never unpickles "
                "weights: convert them once with transformers, e.g. AutoModelForCausalLM.from_pretrained(dir)"
                ".save_pretrained(dir, safe_serialization=True)"
            )
        raise ModelLoadError(
            f"no weights in {self.directory}: expected *.safetensors files (or use --load-format dummy for random "
            "weights)"
        )

    def _files_from_index(self, index: Path) -> list[Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError("'weight_map' must map tensor names to file names")
            shard_names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(
                f"{index} is not a valid safetensors index (needs a 'weight_map'): {_one_line(exc)}"
            ) from exc
        self._weight_map = weight_map
        files = [self.directory / name for name in shard_names]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(
                    f"shard {file.name} named in {index} is missing from {self.directory}: re-download the checkpoint"
                )
        return files

    @property
    def files(self) -> list[Path]:
        """The weight files, in load order."""
        return list(self._files)

    def tensor_specs(self) -> dict[str, TensorSpec]:
        """Every tensor's name, shape and dtype, from the file headers only (no tensor data is read)."""
        if self._specs is None:
            specs: dict[str, TensorSpec] = {}
            for file in self._files:
                for name, spec in read_header(file).items():
                    if name in specs:
                        raise ModelLoadError(
                            f"tensor '{name}' appears in both {specs[name].file.name} and {file.name} in "
                            f"{self.directory}: remove the stray file"
                        )
                    specs[name] = spec
            self._check_index_agrees(specs)
            self._specs = specs
        return dict(self._specs)

    def _check_index_agrees(self, specs: dict[str, TensorSpec]) -> None:
        # An index that points at the wrong shard means the files were mixed from two downloads.
        if self._weight_map is None:
            return
        for name, file_name in self._weight_map.items():
            spec = specs.get(name)
            if spec is None or spec.file.name != file_name:
                raise ModelLoadError(
                    f"{INDEX_FILE} in {self.directory} puts tensor '{name}' in {file_name}, but that file does not "
                    "hold it: re-download the checkpoint"
                )

    def iter_tensors(
        self, names: Iterable[str] | None = None, progress: bool = False, lazy: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
        """Yield (name, CPU tensor) for every tensor, or only for `names`, file by file (memory-mapped reads).

        Headers are validated first, so a truncated or corrupt file fails before any tensor is handed out. `lazy`:
        yield LazyTensors instead, read (in part) by the consumer before it asks for the next one.
        """
        specs = self.tensor_specs()
        if names is None:
            wanted = list(specs)
        else:
            wanted = list(dict.fromkeys(names))
            missing = [n for n in wanted if n not in specs]
            if missing:
                raise ModelLoadError(f"checkpoint {self.directory} has no tensor named {', '.join(missing[:5])}")
        by_file: dict[Path, list[str]] = {file: [] for file in self._files}
        for name in wanted:
            by_file[specs[name].file].append(name)

        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(wanted), desc="loading weights", unit="tensor")
        try:
            for file, file_names in by_file.items():
                if file_names:
                    yield from self._read_file(file, file_names, bar, specs if lazy else None)
        finally:
            if bar is not None:
                bar.close()

    @staticmethod
    def _read_file(
        file: Path, names: list[str], bar: object, lazy_specs: dict[str, TensorSpec] | None = None
    ) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own SafetensorError, OSError, ...
            raise ModelLoadError(f"cannot open {file}: {_one_line(exc)}") from exc
        with handle as f:
            for name in names:
                if lazy_specs is not None:
                    item = LazyTensor(f, lazy_specs[name])
                else:
                    try:
                        item = f.get_tensor(name)
                    except Exception as exc:
                        raise ModelLoadError(f"cannot read tensor '{name}' from {file}: {_one_line(exc)}") from exc
                if bar is not None:
                    bar.update(1)  # type: ignore[attr-defined]
                yield name, item


class LazyTensor:
    """One tensor of an open safetensors file, not read yet: a tensor-parallel rank reads only its part of it
    (`read(index)`, through safetensors' slices), never the whole tensor. Valid until the iterator moves on."""

    def __init__(self, handle: Any, spec: TensorSpec):
        self._handle, self.spec = handle, spec
        self.shape, self.dtype = spec.shape, spec.dtype

    def read(self, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The whole tensor (index None), or `tensor[index]` read from the file alone."""
        try:
            if index is None:
                return self._handle.get_tensor(self.spec.name)
            return self._handle.get_slice(self.spec.name)[index]
        except Exception as exc:
            raise ModelLoadError(
                f"cannot read tensor '{self.spec.name}' from {self.spec.file}: {_one_line(exc)}"
            ) from exc
