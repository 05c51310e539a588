"""``gridrl-auth``: credentials and certificates for a cluster on a shared network.

    gridrl-auth ca --dir certs                                  # certs/ca.crt, certs/ca.key
    gridrl-auth cert --dir certs master --host master.lan       # certs/master.crt, .key
    gridrl-auth mint --authorized-tokens authorized_tokens --scope node --id mac-mini \\
        --address mac-mini.lan:50051 --out mac-mini.token
    gridrl-auth mint --authorized-tokens authorized_tokens --scope trainer --id trainer \\
        --cert certs/trainer.crt --out trainer.token     # usable only with that certificate
    gridrl-auth revoke --authorized-tokens authorized_tokens mac-mini
    gridrl-auth list --authorized-tokens authorized_tokens

Formats and scopes: :mod:`gridrl.common.security.tokens`; certificates: :mod:`gridrl.common.security.certs`.
"""

from __future__ import annotations

import click

from gridrl.common.cli import address_option, env_option
from gridrl.common.security.minting import mint, revoke
from gridrl.common.security.tokens import (
    SCOPES,
    AuthError,
    AuthorizedTokens,
    certificate_file_fingerprint,
)

_authorized = env_option(
    "--authorized-tokens", env="GRIDRL_AUTHORIZED_TOKENS", required=True, show_default=False,
    type=click.Path(dir_okay=False),
    help="The authorized-tokens file the servers read (created when missing).")


def _fail(e: AuthError) -> None:
    raise click.BadParameter(e.problem, param_hint=e.field) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Credentials (tokens with a scope) and TLS certificates for gridrl servers and clients.

    Scopes: node (register and heartbeat its own address), trainer (Generate, PushAdapter,
    ReloadAdapter, and everything read can do), read (list and watch the registry, node info,
    run status). Servers take --authorized-tokens FILE, clients --auth-token-file FILE.
    """


@main.command("mint")
@_authorized
@env_option("--scope", env="GRIDRL_AUTH_SCOPE", required=True, type=click.Choice(SCOPES),
            show_default=False, help="What it may call.")
@env_option("--id", "credential_id", env="GRIDRL_AUTH_ID", required=True, show_default=False,
            help="Who holds it: [A-Za-z0-9][A-Za-z0-9._-]*, unique in the file.")
@address_option("--address", env="GRIDRL_AUTH_ADDRESS", default=None, show_default=False,
            help="node scope: the only host:port the credential may register (its "
                   "--advertise-address).")
@env_option("--cert", env="GRIDRL_AUTH_CERT", default=None, show_default=False,
            type=click.Path(dir_okay=False),
            help="Bind the credential to this client certificate (PEM; its sha256 is stored): "
                 "servers accept the token only from a mutual-TLS client presenting it. Use it "
                 "for the trainer, whose token every rollout node sees.")
@env_option("--out", env="GRIDRL_AUTH_OUT", required=True, type=click.Path(dir_okay=False),
            show_default=False, help="Token file to write (mode 0600; never overwritten).")
def mint_command(authorized_tokens: str, scope: str, credential_id: str, address: str | None,
                 cert: str | None, out: str) -> None:
    """Write a new token to --out and append its sha256, scope and id to the file."""
    try:
        fingerprint = certificate_file_fingerprint(cert) if cert else None
        credential = mint(authorized_tokens, out, scope, credential_id, address, fingerprint)
    except AuthError as e:
        _fail(e)
    bound = f", bound to {credential.address}" if credential.address else ""
    bound += f", bound to certificate {cert}" if cert else ""
    click.echo(f"minted {credential.id} (scope {credential.scope}{bound}): token in {out}, "
               f"sha256 added to {authorized_tokens}")


@main.command("revoke")
@_authorized
@click.argument("credential_id", metavar="ID")
def revoke_command(authorized_tokens: str, credential_id: str) -> None:
    """Remove credential ID; servers refuse its token from their next call on."""
    try:
        credential = revoke(authorized_tokens, credential_id)
    except AuthError as e:
        _fail(e)
    click.echo(f"revoked {credential.id} (scope {credential.scope}) from {authorized_tokens}")


@main.command("list")
@_authorized
def list_command(authorized_tokens: str) -> None:
    """Print the credentials in the file: id, scope, bound address, bound certificate."""
    try:
        credentials = AuthorizedTokens(authorized_tokens).credentials
    except AuthError as e:
        _fail(e)
    width = max(len(c.id) for c in credentials)
    address_width = max(len(c.address or "-") for c in credentials)
    for c in credentials:
        cert = f"cert={c.cert[:19]}..." if c.cert else "-"
        click.echo(f"{c.id.ljust(width)}  {c.scope.ljust(7)}  "
                   f"{(c.address or '-').ljust(address_width)}  {cert}")


@main.command("ca")
@env_option("--dir", "directory", env="GRIDRL_AUTH_DIR", required=True, show_default=False,
            type=click.Path(file_okay=False),
            help="Directory to write ca.crt and ca.key (0600) into.")
@env_option("--name", env="GRIDRL_AUTH_CA_NAME", default="gridrl CA",
            help="The CA's common name.")
def ca_command(directory: str, name: str) -> None:
    """Make a private CA (10 years). Keep ca.key off the cluster's machines."""
    from gridrl.common.security.certs import CertError, make_ca

    try:
        crt, key = make_ca(directory, name)
    except CertError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {crt} and {key}")


@main.command("cert")
@env_option("--dir", "directory", env="GRIDRL_AUTH_DIR", required=True, show_default=False,
            type=click.Path(file_okay=False), help="Directory holding ca.crt and ca.key; NAME.crt and NAME.key go there too.")
@click.argument("name")
@env_option("--host", "hosts", env="GRIDRL_AUTH_HOST", multiple=True, show_default=False,
            help="DNS name or IP the certificate is for (repeatable) [default: NAME]. List "
                   "every name clients dial: --advertise-address, --master.")
def cert_command(directory: str, name: str, hosts: tuple[str, ...]) -> None:
    """Make NAME.crt/NAME.key signed by the CA (825 days), valid as server and client
    certificate: one per machine."""
    from gridrl.common.security.certs import CertError, make_cert

    try:
        crt, key = make_cert(directory, name, list(hosts) or [name])
    except CertError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {crt} and {key} for {', '.join(hosts or (name,))}")


if __name__ == "__main__":
    main()
