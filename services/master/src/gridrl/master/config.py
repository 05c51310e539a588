"""The master's settings, declared once: how often nodes heartbeat, when a silent node is
marked unhealthy and then removed (:class:`Liveness`), and where the dashboard listens
(:class:`DashboardSettings`).

Each is one field of :class:`Liveness` or :class:`DashboardSettings` (:func:`gridrl.common.settings.setting`): from it come
the ``gridrl-master serve`` flag, its ``GRIDRL_MASTER_<FLAG>`` environment variable, its help,
its default (for the command line, :class:`gridrl.master.server.Master` and
:class:`gridrl.master.registry.Registry` alike) and its check (:meth:`Liveness.validate`).
"""

from __future__ import annotations

from dataclasses import dataclass

from gridrl.common import settings
from gridrl.common.errors import invalid_argument
from gridrl.common.settings import above, at_least, setting

ENV_PREFIX = "GRIDRL_MASTER_"


@dataclass(frozen=True)
class Liveness:
    """When the master hears from nodes, and what silence means (seconds; increasing)."""

    heartbeat_interval_s: float = setting(
        5.0, "Seconds between heartbeats the master asks nodes for.",
        flag="--heartbeat-interval", check=above(0))
    unhealthy_after_s: float = setting(
        15.0, "Seconds without a heartbeat before a node is marked unhealthy.",
        flag="--unhealthy-after", check=above(0))
    expire_after_s: float = setting(
        60.0, "Seconds without a heartbeat before a node is removed.",
        flag="--expire-after", check=above(0))

    def validate(self) -> None:
        """Each duration > 0, and ``heartbeat_interval_s < unhealthy_after_s <
        expire_after_s``.

        Raises:
            StatusError: INVALID_ARGUMENT naming the flag.
        """
        settings.validate(self)
        h, u, e = self.heartbeat_interval_s, self.unhealthy_after_s, self.expire_after_s
        if not h < u < e:
            raise invalid_argument("--unhealthy-after" if u <= h else "--expire-after",
                                   f"need --heartbeat-interval ({h}) < --unhealthy-after ({u}) "
                                   f"< --expire-after ({e})")

    @property
    def sweep_every_s(self) -> float:
        """How often the sweeper applies liveness: every heartbeat interval, at least four
        times per unhealthy-after, never more often than every 20 ms."""
        return max(0.02, min(self.heartbeat_interval_s, self.unhealthy_after_s / 4))


@dataclass(frozen=True)
class DashboardSettings:
    """Where the master serves its dashboard (:mod:`gridrl.master.dashboard`)."""

    dashboard_port: int = setting(
        8321, "The dashboard's HTTP port, on the --listen host (0: any free port, -1: off); "
              "HTTPS with the --tls-* files, and a read credential when --authorized-tokens "
              "is set.", check=at_least(-1))
