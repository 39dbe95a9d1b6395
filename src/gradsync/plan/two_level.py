"""Predicted all-reduce time on hosts of several ranks: a fast link inside, a slow one between.

Every algorithm of ``gradsync.engine.transport.algorithms`` is a fixed sequence of rounds of
point-to-point messages; this module lists the same rounds (``schedule``) and
prices them with two alpha-beta links (Hockney's model, one ``Link`` each for
inside a host and between hosts, as ``gradsync netlab calibrate`` measures them):

* a message between two ranks of one host costs ``intra.alpha + bytes * intra.beta``;
* messages of one round that leave (enter) a host share that host's link: the
  round's inter-host part costs ``inter.alpha + max over hosts of the bytes out of
  (into) the host * inter.beta`` -- the emulated network limits each direction of
  each host's link, and real NICs do;
* a round lasts as long as its slowest part; rounds run one after the other.

That one rule yields the textbook costs (Thakur, Rabenseifner and Gropp 2005) and
what they leave out. With N = H g ranks, S bytes, and the ring laid out host by
host (as torchrun numbers ranks), every ring round sends S/N across each host
boundary: a flat ring costs ``2(N-1) (alpha_e + S/N beta_e)``. The hierarchical
all-reduce sends S/g per rank in parallel across hosts, S/H per host per round:
``2(g-1)(alpha_i + S/g beta_i) + 2(H-1)(alpha_e + S/H beta_e)``, i.e. a factor
(N-1)/N / ((H-1)/H) less inter-host volume (1.5x at 2 hosts x 2 ranks) and 2(N-H)
fewer inter-host latencies. The parameter server's root link receives (N-g) S
from the other hosts in its first round and sends as much in its second: its time
grows linearly with the workers while the ring's stays about 2 S beta_e.

Not modelled: the CPU time of the additions, gloo's per-message overheads beyond
alpha, TCP slow start, and contention of co-running ranks for the machine's cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UsageError

ALGORITHMS = ("ring", "tree", "server", "hierarchical")
INNER = ("ring", "tree", "server")


@dataclass(frozen=True)
class Link:
    """One alpha-beta link: a message of n bytes costs ``alpha_s + n * beta_s_per_byte``."""

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self) -> None:
        for name in ("alpha_s", "beta_s_per_byte"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise UsageError(f"link {name} must be a number >= 0, got {v!r}")

    def time(self, nbytes: float) -> float:
        return self.alpha_s + nbytes * self.beta_s_per_byte

    @property
    def bandwidth(self) -> float:
        return math.inf if self.beta_s_per_byte == 0 else 1.0 / self.beta_s_per_byte


@dataclass(frozen=True)
class TwoLevelTopology:
    """``hosts`` hosts of ``ranks_per_host`` ranks (rank r on host r // ranks_per_host)."""

    hosts: int
    ranks_per_host: int
    intra: Link
    inter: Link

    def __post_init__(self) -> None:
        for name in ("hosts", "ranks_per_host"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UsageError(f"{name} must be an integer >= 1, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host


Message = tuple[int, int, float]  # (source rank, destination rank, bytes)


@dataclass(frozen=True)
class AlgorithmCost:
    algorithm: str
    nbytes: float
    seconds: float
    rounds: int
    max_host_out_bytes: float  # the busiest host link's bytes in one direction, all rounds
    inter_rounds: int  # rounds with at least one inter-host message


# -- schedules (global ranks; the engine's algorithms send exactly these messages) --------

def _ring(members: list[int], nbytes: float) -> list[list[Message]]:
    n = len(members)
    if n == 1:
        return []
    step = [(members[i], members[(i + 1) % n], nbytes / n) for i in range(n)]
    return [step] * (2 * (n - 1))  # one list for identical rounds: priced once (predict)


def _ring_half(members: list[int], nbytes: float) -> list[list[Message]]:
    """Reduce-scatter (or all-gather) half of a ring: N-1 rounds of S/N per rank."""
    return _ring(members, nbytes)[: len(members) - 1]


def _tree(members: list[int], nbytes: float) -> list[list[Message]]:
    n = len(members)
    rounds, mask = [], 1
    while mask < n:
        rounds.append([(members[r + mask], members[r], nbytes)
                       for r in range(0, n, 2 * mask) if r + mask < n])
        mask <<= 1
    return rounds + [[(d, s, b) for s, d, b in rnd] for rnd in reversed(rounds)]


def _server(members: list[int], nbytes: float, root: int = 0) -> list[list[Message]]:
    if len(members) == 1:
        return []
    others = [m for i, m in enumerate(members) if i != root]
    return [[(m, members[root], nbytes) for m in others],
            [(members[root], m, nbytes) for m in others]]


_FLAT = {"ring": _ring, "tree": _tree, "server": _server}


def _merge(parallel: list[list[list[Message]]]) -> list[list[Message]]:
    """Schedules running at once on disjoint groups: round k is every group's round k."""
    depth = max((len(s) for s in parallel), default=0)
    merged: dict[tuple[int, ...], list[Message]] = {}  # identical rounds stay one list
    out = []
    for k in range(depth):
        parts = [s[k] for s in parallel if k < len(s)]
        key = tuple(map(id, parts))
        if key not in merged:
            merged[key] = [m for part in parts for m in part]
        out.append(merged[key])
    return out


def schedule(algorithm: str, nbytes: float, hosts: int, ranks_per_host: int,
             inter: str = "ring") -> list[list[Message]]:
    """The rounds of messages ``algorithm`` sends for an all-reduce of ``nbytes``.

    Identical rounds (a ring's 2(N-1)) may be one shared list, so ``predict`` prices
    each once: read the rounds, do not mutate them."""
    if nbytes < 0:
        raise UsageError(f"message size must be >= 0 bytes, got {nbytes}")
    g, world = ranks_per_host, hosts * ranks_per_host
    if algorithm in _FLAT:
        return _FLAT[algorithm](list(range(world)), nbytes)
    if algorithm != "hierarchical":
        raise UsageError(f"unknown algorithm {algorithm!r}; choose from {', '.join(ALGORITHMS)}")
    if inter not in INNER:
        raise UsageError(f"unknown inter-host algorithm {inter!r}; choose from {', '.join(INNER)}")
    hosts_ranks = [list(range(h * g, (h + 1) * g)) for h in range(hosts)]
    columns = [[h * g + j for h in range(hosts)] for j in range(g)]
    half = _merge([_ring_half(m, nbytes) for m in hosts_ranks])
    across = _merge([_FLAT[inter](c, nbytes / g) for c in columns])
    return half + across + half


def round_time(messages: list[Message], topo: TwoLevelTopology) -> float:
    """One round: intra-host messages each on their own, inter-host ones sharing host links."""
    g = topo.ranks_per_host
    intra = [b for s, d, b in messages if s // g == d // g]
    out: dict[int, float] = {}
    into: dict[int, float] = {}
    for s, d, b in messages:
        if s // g != d // g:
            out[s // g] = out.get(s // g, 0.0) + b
            into[d // g] = into.get(d // g, 0.0) + b
    t = max((topo.intra.time(b) for b in intra), default=0.0)
    if out:
        t = max(t, topo.inter.time(max(max(out.values()), max(into.values()))))
    return t


def predict(algorithm: str, nbytes: float, topo: TwoLevelTopology,
            inter: str = "ring") -> AlgorithmCost:
    """Predicted time of one all-reduce of ``nbytes`` on ``topo``."""
    rounds = schedule(algorithm, nbytes, topo.hosts, topo.ranks_per_host, inter)
    g = topo.ranks_per_host
    per_host = [0.0] * topo.hosts
    inter_rounds = 0
    seconds = 0.0
    priced: dict[int, tuple[float, dict[int, float]]] = {}  # a ring repeats one round 2(N-1)
    for rnd in rounds:  # 4,096 ranks, all four algorithms: 0.2 s instead of 10 s
        if id(rnd) not in priced:
            out: dict[int, float] = {}
            for s, d, b in rnd:
                if s // g != d // g:
                    out[s // g] = out.get(s // g, 0.0) + b
            priced[id(rnd)] = (round_time(rnd, topo), out)
        t, out = priced[id(rnd)]
        seconds += t
        inter_rounds += bool(out)
        for h, b in out.items():
            per_host[h] += b
    return AlgorithmCost(algorithm, float(nbytes), seconds, len(rounds), max(per_host),
                         inter_rounds)


def compare(nbytes: float, topo: TwoLevelTopology) -> tuple[AlgorithmCost, ...]:
    """Every algorithm's predicted all-reduce time for ``nbytes`` on ``topo``, fastest first."""
    return tuple(sorted((predict(a, nbytes, topo) for a in ALGORITHMS),
                        key=lambda c: c.seconds))


@dataclass(frozen=True)
class TwoLevelRow:
    """Every algorithm's all-reduce at one worker count, in ``ALGORITHMS`` order."""

    workers: int
    hosts: int
    costs: tuple[AlgorithmCost, ...]

    @property
    def fastest(self) -> AlgorithmCost:
        return min(self.costs, key=lambda c: c.seconds)


@dataclass(frozen=True)
class TwoLevelPlan:
    """``plan_two_level``'s answer: one gradient all-reduce per step, priced per algorithm."""

    nbytes: float
    ranks_per_host: int
    intra: Link
    inter: Link
    rows: tuple[TwoLevelRow, ...]


def plan_two_level(nbytes: float, workers: list[int], ranks_per_host: int, intra: Link,
                   inter: Link) -> TwoLevelPlan:
    """Each algorithm's all-reduce of ``nbytes`` at every worker count, hosts of
    ``ranks_per_host`` ranks joined by ``inter`` (``gradsync plan comm --links``)."""
    if not workers or any(not isinstance(w, int) or w < 1 for w in workers):
        raise UsageError(f"worker counts must be integers >= 1, got {workers}")
    if not isinstance(ranks_per_host, int) or isinstance(ranks_per_host, bool) \
            or ranks_per_host < 1:
        raise UsageError(f"ranks per host must be an integer >= 1, got {ranks_per_host!r}")
    uneven = [w for w in workers if w % ranks_per_host]
    if uneven:
        raise UsageError(f"worker counts {uneven} do not fill hosts of {ranks_per_host} ranks; "
                         f"use multiples of {ranks_per_host}")
    rows = []
    for w in workers:
        topo = TwoLevelTopology(w // ranks_per_host, ranks_per_host, intra, inter)
        rows.append(TwoLevelRow(w, topo.hosts, tuple(predict(a, nbytes, topo)
                                                     for a in ALGORITHMS)))
    return TwoLevelPlan(float(nbytes), ranks_per_host, intra, inter, tuple(rows))
