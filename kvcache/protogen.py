"""Generate the gRPC Python modules from proto/ (run: ``python -m kvcache.protogen``).

Generated code is never edited by hand and never committed: it is written next to the
packages (``kvcache/v1/``, ``model_runtime/v1/``) by this step, which the setup script
and CI run after installing.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO / "proto"


def generate(proto_dir: Path = PROTO_DIR, out_dir: Path = REPO) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc  # imported lazily: only this step needs grpcio-tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(proto_dir.rglob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {proto_dir}")
    for proto in protos:
        rel = proto.relative_to(proto_dir)
        pkg_dir = out_dir / rel.parent
        pkg_dir.mkdir(parents=True, exist_ok=True)
        (pkg_dir / "__init__.py").touch()
        args = [
            "protoc",
            f"-I{proto_dir}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(proto),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto}")
    return protos


def main() -> None:
    protos = generate()
    print(f"generated gRPC modules for {len(protos)} proto file(s)", file=sys.stderr)


if __name__ == "__main__":
    main()
