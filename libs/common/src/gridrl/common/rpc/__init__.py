"""gRPC plumbing shared by the three services: the server (health, reflection, size limits,
shutdown), its one interceptor (credentials, scopes, domain errors -> status, RPC metrics),
client channels, the reflection probe that tells which service answers at an address, and the
one Prometheus setup."""
