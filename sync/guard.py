"""Host side of the guarded waits: the wait-site registry and the error record decoder.

A launch never hangs: a wait that runs out of its budget records {site, cta, wanted, seen} in the
launch header and the launch ends early. The host reads the header after the launch and raises
`HandoffTimeout` naming the site; the next launch gets a fresh tag and runs normally.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import header as H

DEFAULT_TIMEOUT_S = 1.0


class HandoffTimeout(Exception):
    """A guarded wait of a launch ran out of budget (or the launch aborted because one did)."""

    def __init__(self, site: str, cta: int, wanted: int, seen: int, *, site_id: int = -1, launch: str = ""):
        self.site, self.cta, self.wanted, self.seen, self.site_id, self.launch = site, cta, wanted, seen, site_id, launch
        where = f" in launch {launch!r}" if launch else ""
        super().__init__(f"hand-off timeout at wait site {site!r} (#{site_id}){where}: CTA {cta} wanted tag "
                         f"{wanted & 0xFFFFFFFF:#010x}, saw {seen & 0xFFFFFFFF:#010x}")


class SiteRegistry:
    """Wait-site names in schedule order; a site's number is its index (the kernels' `site` argument).

    The producer publishing to a site shares the number, so `fault_site=id` makes exactly that
    producer skip its publish."""

    def __init__(self, names: list[str] | tuple[str, ...]):
        names = list(names)
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"wait-site names must be unique; repeated: {dup}")
        self.names = names

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def id(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise KeyError(f"unknown wait site {name!r}; this launch has {self.names}") from None

    def name(self, site_id: int) -> str:
        if 0 <= site_id < len(self.names):
            return self.names[site_id]
        return f"<unknown site {site_id}>"


@dataclass(frozen=True)
class Record:
    epoch: int
    last_tag: int
    abort: int
    err_tag: int
    site: int
    cta: int
    wanted: int
    seen: int

    @property
    def failed(self) -> bool:
        """True when the latest launch recorded an error (the record carries its tag)."""
        return self.err_tag == self.last_tag and self.last_tag != 0


def read_record(hdr) -> Record:
    """Decode a header tensor (int32, >= HEADER_WORDS words, any device)."""
    w = hdr.reshape(-1)[: H.HEADER_WORDS].cpu().tolist()
    e = w[H.ERR: H.ERR + 5]
    return Record(epoch=w[H.EPOCH], last_tag=w[H.LAST_TAG], abort=w[H.ABORT], err_tag=e[0], site=e[1], cta=e[2],
                  wanted=e[3], seen=e[4])


def check_record(hdr, sites: SiteRegistry, launch: str = "") -> Record:
    """Raise HandoffTimeout if the latest launch using this header recorded a timeout."""
    r = read_record(hdr)
    if r.failed:
        raise HandoffTimeout(sites.name(r.site), r.cta, r.wanted, r.seen, site_id=r.site, launch=launch)
    return r


def timeout_ns(timeout_s: float) -> int:
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not (0 < timeout_s <= 60):
        raise ValueError(f"timeout_s={timeout_s!r}: must be a number in (0, 60] seconds")
    return int(timeout_s * 1e9)
