"""Who may call what: token files and authorized-tokens files (:mod:`.tokens`), the scopes
of each RPC (:mod:`.access`), minting and revoking (:mod:`.minting`; the ``gridrl-auth``
command is :mod:`gridrl.common.auth_cli`), TLS files (:mod:`.tls`) and local certificates
(:mod:`.certs`), and the one object every server and channel takes with the rule that keeps
an unprotected server on loopback (:mod:`.policy`)."""
