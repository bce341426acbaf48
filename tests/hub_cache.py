"""Lay a checkpoint out as huggingface_hub's cache does, for offline tests of Hub ids."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

TEST_REVISION = "0123456789abcdef0123456789abcdef01234567"


def lay_out_hub_cache(model_dir: Path, cache: Path, repo_id: str, revision: str = TEST_REVISION,
                      ref: str = "main") -> Path:
    """Put model_dir's files into `cache` as the Hub's cache holds `repo_id` at `revision`:
    models--owner--name/{blobs/<sha256>, snapshots/<revision>/<file> -> ../../blobs/<sha256>, refs/<ref>}.
    Returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in sorted(model_dir.iterdir()):
        if not path.is_file():
            continue
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(path, blob)
        link = snapshot / path.name
        link.unlink(missing_ok=True)
        link.symlink_to(Path("..") / ".." / "blobs" / digest)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(revision)
    return snapshot
