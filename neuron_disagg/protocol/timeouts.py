"""Every timeout's default, in one place. Each side's timeouts (``ProducerTimeouts``,
``ConsumerTimeouts``, ``LenderTimeouts``, ``ReaderTimeouts``) take their defaults from here, and so
do the config's knobs of the same names, so a default changed here changes everywhere at once.

The fields share their names with the config's knobs and with each side's timeouts: ``for_side``
picks a side's fields by name. Everything is keyword-only, as a row of bare numbers in the wrong
order would still type-check.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    lease_s: float = 30.0                # P holds finished blocks this long without word from D
    heartbeat_interval_s: float = 5.0    # D renews P's lease this often
    watchdog_s: float = 120.0            # D waits this long for KV after registering; caps P's wait too
    admission_timeout_s: float = 300.0   # D waits this long to allocate blocks
    max_write_s: float = 30.0            # push: a write that takes longer is given up (and drained as long again)
    max_read_s: float = 30.0             # pull: a READ that takes longer is given up (and drained as long again)
    clock_skew_allowance_s: float = 1.0  # added to fences: clock skew + tick interval
    tombstone_s: float = 600.0           # ended transfers are remembered this long
    suspect_after_s: float = 3.0         # D: a P rank that answers no probe for this long is gone
    params_ttl_s: float = 600.0          # the router's signed kv_transfer_params are honoured this long

    def for_side(self, side: type[T]) -> T:
        """``side``'s timeouts (e.g. ``ProducerTimeouts``) with this object's values."""
        return side(**{f.name: getattr(self, f.name) for f in fields(side)})


DEFAULTS = Timeouts()
