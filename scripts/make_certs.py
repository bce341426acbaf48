"""Make a local CA, a server certificate and client certificates for mmserve's TLS and mutual TLS.

    python scripts/make_certs.py --out certs/ --server-name localhost --server-name 127.0.0.1 \
        --server-name encoder --server-name decoder --client decoder --client client

writes certs/ca.pem (+ ca.key), certs/server.pem + server.key and certs/client-NAME.pem + .key. The
client's NAME is its certificate's common name: `--auth-cert-service decoder` on the encoder makes the
`decoder` certificate a service identity. Needs `cryptography` (pip install -e '.[tls]'). For a local
or test setup only: keep ca.key away from the services, or delete it once the certificates exist.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.security.certs import DEFAULT_SERVER_NAMES, make_local_pki  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--server-name", action="append", default=[],
                   help=f"a DNS name or IP the server certificate is valid for (repeatable; default "
                   f"{', '.join(DEFAULT_SERVER_NAMES)})")
    p.add_argument("--client", action="append", default=[],
                   help="make a client certificate with this common name (repeatable; default: client)")
    p.add_argument("--days", type=int, default=365)
    args = p.parse_args(argv)
    pki = make_local_pki(args.out, args.server_name or DEFAULT_SERVER_NAMES, args.client or ["client"],
                         args.days)
    print(f"CA           {pki.ca_cert}  (its key: {pki.ca_key})")
    print(f"server       {pki.server_cert}  {pki.server_key}")
    for name, (cert, key) in pki.clients.items():
        print(f"client {name:<6} {cert}  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
