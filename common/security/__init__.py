"""Transport security and tenant authentication for both services (docs/security.md).

- tls.py: server and channel credentials from PEM files (TLS, mutual TLS);
- identity.py: who a call is (a tenant or a service) and the salt and lease-owner scoping that follows;
- tokens.py: the bearer-token file that maps tokens to identities;
- auth.py: the guard wrapped around each handler that authenticates each RPC and scopes its request;
- client_auth.py: the client side: bearer token and tenant metadata on every call;
- options.py: the command-line flags of servers and clients;
- certs.py: a local CA, server and client certificates (needs the `cryptography` package).
"""
