"""Describe an artifact for humans: what it holds, and whether it is valid."""

from __future__ import annotations

import json
from pathlib import Path

from artifacts import Artifact, ArtifactError, ModelInfo, same_model
from artifacts.format import tensor_filename
from artifacts.schema import SCHEMAS

_MIB = 1 << 20


def describe_artifact(path: Path | str, model_info: ModelInfo | None = None) -> tuple[str, bool]:
    """Return a multi-line report on the artifact at `path` and whether it is valid.

    Valid means every stage file passes its checksum, every stage of tensors loads and fits its schema
    as the runtime reads it, no interrupted write left temporary files behind and, when `model_info`
    is given, the artifact was built for that model.
    """
    try:
        artifact = Artifact.open(path)
    except ArtifactError as e:
        return f"artifact: {path}\nerror: {e}\nvalid: no", False
    stage_lines, problems = _stage_report(artifact)
    problems += artifact.leftover_problems()
    checked = []  # the line that says --check-model compared the fingerprints, when they match
    if model_info is not None:
        if same_model(artifact.model, model_info):
            checked.append(f"model check: {model_info.name} matches its fingerprint ({model_info.fingerprint_prefix})")
        else:
            problems.append(f"built for {artifact.model.name} ({artifact.model.fingerprint_prefix}), "
                            f"not {model_info.name} ({model_info.fingerprint_prefix})")
    valid = not problems
    lines = [
        f"artifact: {artifact.path}",
        *_header_lines(artifact),
        *checked,
        *stage_lines,
        *(f"problem: {p}" for p in problems),
        f"valid: {'yes' if valid else 'no'}",
    ]
    return "\n".join(lines), valid


def _header_lines(artifact: Artifact) -> list[str]:
    """Return the format, provenance and model lines of the report."""
    manifest, model = artifact.manifest, artifact.model
    return [
        f"format_version: {manifest.format_version}",
        f"created_by: {manifest.created_by}",
        f"model: {model.name} ({model.architecture}, vocab {model.vocab_size}, hidden {model.hidden_size})",
        f"  source: {model.source}",
        f"  fingerprint: {model.fingerprint_prefix}",
        f"stages: {', '.join(artifact.stages) or 'none'}",
    ]


def _stage_report(artifact: Artifact) -> tuple[list[str], list[str]]:
    """Return per-stage lines (created_at, params, files with checksum status) and file problems.

    A stage of tensors whose files pass their checksums is also read as the runtime reads it (safetensors,
    then its schema).
    """
    lines: list[str] = []
    problems: list[str] = []
    for name in artifact.stages:
        record = artifact.manifest.stages[name]
        lines += [
            f"[{name}] created {record.created_at}",
            f"  params: {json.dumps(record.params, sort_keys=True)}",
        ]
        intact = True  # every file of this stage passed its checksum
        for filename, file in record.files.items():
            # Its status feeds both the line and validity (read_stage below hashes a tensor file once more).
            problem = artifact.check_file(name, filename)
            lines.append(f"  {filename}: {file.size / _MIB:.2f} MiB, {problem or 'checksum ok'}")
            if problem:
                problems.append(f"stage {name!r}: {problem}")
                intact = False
        readable = name in SCHEMAS and tensor_filename(name) in record.files  # what the runtime reads as tensors
        if readable and intact:
            try:
                artifact.read_stage(name)
            except ArtifactError as e:
                lines.append("  contents: cannot be used (the problem below)")
                problems.append(str(e))
    return lines, problems
