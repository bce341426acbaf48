"""Regenerate the gRPC stubs in common/pb from protos/ (needs grpcio-tools==1.84.0).

Stubs come from grpcio-tools 1.84.0 on purpose: newer generators emit a runtime check that older
grpcio (1.84 on the GPU test host) refuses. Imports are rewritten to be package-relative so the stubs
live inside `common.pb` instead of a top-level `mmserve` package.

    python scripts/gen_protos.py           # write common/pb
    python scripts/gen_protos.py --check   # exit 1 if common/pb differs from the protos
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_DIR = ROOT / "common" / "pb"
REQUIRED_TOOLS_VERSION = "1.84.0"
_IMPORT = re.compile(r"^from mmserve\.v1 import (\w+)", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every proto and write package-relative stubs into out_dir."""
    import grpc_tools
    from grpc_tools import protoc

    version = getattr(grpc_tools, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("grpcio-tools")
    if version != REQUIRED_TOOLS_VERSION:
        raise SystemExit(f"grpcio-tools=={REQUIRED_TOOLS_VERSION} is required, found {version}")
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", *protos]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for src in sorted((Path(tmp) / "mmserve" / "v1").iterdir()):
            text = _IMPORT.sub(r"from . import \1", src.read_text())
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
    (out_dir / "__init__.py").write_text('"""Generated gRPC stubs (scripts/gen_protos.py)."""\n')
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    if not args.check:
        for path in generate(OUT_DIR):
            print(path.relative_to(ROOT))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [p.name for p in fresh if not (OUT_DIR / p.name).exists()
                 or (OUT_DIR / p.name).read_text() != p.read_text()]
    if stale:
        print("stale stubs: " + ", ".join(stale) + " (run python scripts/gen_protos.py)")
        return 1
    print("stubs up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
