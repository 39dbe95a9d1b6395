"""The words of a desync error: which ranks, which step, which collective.

``item_window.py`` gathers one account per rank when the window fingerprints
differ; :func:`explain` turns the accounts into the message every rank raises
(computed from the same gathered data, so identical on every rank).
"""

from __future__ import annotations


def _ranks(rs: list[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def _groups(infos: list[dict], key) -> list[tuple[object, list[int]]]:
    """Ranks grouped by ``key(info)``; the largest group (ties: the one with the lowest
    rank) first, as the reference the others are named against."""
    groups: dict = {}
    for info in infos:
        groups.setdefault(key(info), []).append(info["rank"])
    return sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))


def _collective(entry) -> str:
    if entry is None:
        return "nothing (it issued fewer collectives)"
    seq, op, dtype, numel, tag = entry
    tag = f" '{tag}'" if tag else ""
    return f"{op} #{seq}{tag} ({dtype} x {numel})"


def first_difference(infos: list[dict]) -> str | None:
    """The first position since the previous check where the ranks' collectives differ."""
    lists = [info["records"] for info in infos]
    counts = [info["count"] for info in infos]
    longest = max(len(x) for x in lists)
    for i in range(longest):
        entries = [x[i] if i < len(x) else None for x in lists]
        keys = [None if e is None else e[1:4] for e in entries]
        if len(set(keys)) > 1:
            groups = _groups([dict(info, records=entries[k]) for k, info in enumerate(infos)],
                             lambda info: None if info["records"] is None
                             else info["records"][1:4])
            parts = []
            for _key, ranks in groups:
                e = entries[[info["rank"] for info in infos].index(ranks[0])]
                parts.append(f"{_ranks(ranks)} issued {_collective(e)}")
            return "first differing collective: " + "; ".join(parts)
    if len(set(counts)) > 1:
        return ("first differing collective: the ranks issued "
                + ", ".join(f"{c} (rank {info['rank']})" for c, info in zip(counts, infos))
                + " collectives since the previous check")
    return None


def explain(infos: list[dict]) -> str:
    steps = sorted({info["step"] for info in infos})
    step = (f"step {steps[0]}" if len(steps) == 1
            else "steps " + ", ".join(f"{i['step']} (rank {i['rank']})" for i in infos))
    log = infos[0]["log"]
    check = infos[0]["check"]
    lines = [f"ranks disagree at {step} (synchronised backward; checked at collective "
             f"#{check} on group {log}, which carries the window's item count): the "
             "replicas would drift from here"]
    diff = first_difference(infos)
    if diff:
        groups = _groups(infos, lambda i: tuple(tuple(r[1:4]) for r in i["records"]))
        odd = sorted(r for _k, rs in groups[1:] for r in rs)
        lines.append(f"{_ranks(odd)} issued collectives the others did not; {diff}")
    if not any(info["join"] for info in infos):
        by_steps = _groups(infos, lambda i: (i["steps"], i["dirty"]))
        if len(by_steps) > 1:
            odd = sorted(r for _k, rs in by_steps[1:] for r in rs)
            parts = []
            for (n, dirty), ranks in by_steps:
                part = f"{_ranks(ranks)} took {n} optimizer step(s) since the previous one"
                if dirty:
                    part += (f", {dirty} of them with micro-steps accumulated under no_sync "
                             "after the synchronised backward (stepping on gradients that "
                             "were never synchronised)")
                parts.append(part)
            lines.append(f"{_ranks(odd)} stepped differently: " + "; ".join(parts)
                         + " (mismatched no_sync, or a different number of synchronised "
                         "backwards per step)")
    lines.append("micro-steps in this window: " + ", ".join(
        f"{info['passes']} (rank {info['rank']})" for info in infos))
    lines.append("every rank must issue the same collectives and synchronise at the same "
                 "micro-steps; set GRADSYNC_DESYNC_CHECK=0 to turn this check off")
    return "\n".join(lines)
