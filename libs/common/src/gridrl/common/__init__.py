"""Plumbing shared by the three gridrl services, one job per module or sub-package:

- :mod:`.rpc`: gRPC server wiring (health, reflection, size limits, shutdown), the one server
  interceptor, channels, the reflection probe, the one metrics setup;
- :mod:`.security`: credentials and scopes, TLS, certificates, ``gridrl-auth``;
- :mod:`.errors`: the domain error (a field and a kind; no gRPC);
- :mod:`.settings`: settings declared once (flag, environment variable, check, help);
- :mod:`.cli`: click flags shared by every command (server, security, output);
- :mod:`.address`: host:port;
- :mod:`.transport`: the PushAdapter wire format, both ends;
- :mod:`.registration`: a node's client of the master (register, heartbeat, deregister);
- :mod:`.sequence`: the order of a node's reports;
- :mod:`.progress`: status lines for long waits;
- :mod:`.faults`: pause points for fault tests (test hooks only).
"""

__version__ = "0.1.0"
