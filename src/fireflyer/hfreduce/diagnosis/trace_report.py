"""``fireflyer hfreduce trace DIR``: which rank a failed or hung job waited for, from its flight recorder dumps.

Reads the JSON dumps (``hfreduce_rank_R.json``) that :mod:`fireflyer.hfreduce.diagnosis.flight` writes,
never the pickles beside them: a trace file is data, not code. Per process group it reports
which ranks dumped and which did not (a rank without a dump is the prime suspect: dead, or hung
outside hfreduce), the first collective that not every rank completed, each rank's state there
and whom it waited on, the rank(s) the waits end at, and any collective whose op, sizes or
dtypes differ across ranks at the same sequence number. Sends and receives are not collectives
(each rank numbers its own); where every collective completed, the ones still pending and the
peers they waited on are reported instead. Ranks are global ranks.

:func:`load` checks the files, :func:`analyse` is pure (dumps in, plain data out),
:func:`render` makes the text.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from fireflyer.cliutil import ArgumentParser, doc_summary, plural
from fireflyer.errors import UserError
from fireflyer.hfreduce.diagnosis.flight import DIR_ENV, FORMAT, FORMAT_VERSION, JSON_PREFIX, JSON_SUFFIX

_DONE = ("completed", "aged out")  # states that let a rank move past a collective
_MISMATCH_CAP = 10
_ROW_CAP = 16  # lines of per-rank state before the ranks that merely wait on another are summed up


# ---------------------------------------------------------------------- loading
def load(folder: str | Path) -> list[dict]:
    """The dumps in ``folder``, checked; UserError (one line) for anything a reader cannot trust."""
    d = Path(folder)
    if not d.is_dir():
        raise UserError(f"{d}: no such directory (point it at the folder of the flight recorder dumps)")
    files = sorted(d.glob(f"{JSON_PREFIX}*{JSON_SUFFIX}"), key=lambda p: (len(p.name), p.name))
    if not files:
        raise UserError(f"{d}: no hfreduce trace dumps ({JSON_PREFIX}<rank>{JSON_SUFFIX}); ranks write them "
                        f"when a collective fails, into ${DIR_ENV} (default: "
                        "<tmp>/fireflyer-hfreduce-trace/<job>)")
    dumps = [_load_one(p) for p in files]
    _check_membership(dumps)
    return dumps


def _load_one(path: Path) -> dict:
    stem = path.name[len(JSON_PREFIX): -len(JSON_SUFFIX)]
    if not stem.isdigit():
        raise UserError(f"{path}: not a dump's name ({JSON_PREFIX}<rank>{JSON_SUFFIX})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); a dump is written atomically, "
                        "so this file was damaged or is not a dump") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read it ({exc})") from None
    where = path.name
    _need(data, dict, where)
    if data.get("format") != FORMAT:
        raise UserError(f"{path}: not an hfreduce trace dump (its format is {data.get('format')!r}, not {FORMAT!r})")
    if data.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path}: dump format version {data.get('format_version')!r}; this fireflyer reads "
                        f"version {FORMAT_VERSION}")
    rank = _field(data, "rank", int, where)
    if rank != int(stem):
        raise UserError(f"{path}: the file says it is rank {rank}, its name says rank {stem}")
    for key in ("hostname", "reason"):
        _field(data, key, str, where)
    _field(data, "pid", int, where)
    _field(data, "dumped_at_ns", int, where)
    groups = _field(data, "groups", dict, where)
    for name, g in groups.items():
        gw = f"{where}: group {name!r}"
        _need(g, dict, gw)
        size = _field(g, "world_size", int, gw)
        members = _field(g, "global_ranks", list, gw)
        grank = _field(g, "rank", int, gw)
        if len(members) != size or not all(_is_int(r) for r in members) or len(set(members)) != size:
            raise UserError(f"{path}: group {name!r} lists {members!r} as its {size} ranks")
        if not 0 <= grank < size or members[grank] != rank:
            raise UserError(f"{path}: rank {rank} is outside group {name!r} (its ranks are {_ranges(members)})")
        _field(g, "desc", str, gw)
    for i, e in enumerate(_field(data, "entries", list, where)):
        ew = f"{where}: entry {i}"
        _need(e, dict, ew)
        pg = _field(e, "process_group", list, ew)
        if len(pg) != 2 or pg[0] not in groups:
            raise UserError(f"{path}: entry {i} names group {pg!r}, which the dump does not describe")
        _field(e, "collective_seq_id", int, ew)
        for key in ("op", "state"):
            _field(e, key, str, ew)
        for key in ("input_sizes", "input_dtypes", "output_sizes", "output_dtypes", "waiting_on_global"):
            _field(e, key, list, ew)
        for key in ("waiting_for", "error"):
            if e.get(key) is not None:
                _field(e, key, str, ew)
        for key in ("time_created_ns", "time_discovered_started_ns", "waiting_since_ns"):
            if e.get(key) is not None:
                _field(e, key, int, ew)
    data["file"] = str(path)
    return data


def _check_membership(dumps: list[dict]) -> None:
    """Every dump must agree on the members of every group they share."""
    seen: dict[str, tuple[list[int], int]] = {}
    for dump in dumps:
        for name, g in dump["groups"].items():
            members = g["global_ranks"]
            if name in seen and seen[name][0] != members:
                other = seen[name][1]
                raise UserError(f"rank {dump['rank']} and rank {other} disagree on group {name!r}: "
                                f"{_ranges(members)} against {_ranges(seen[name][0])} (dumps from different jobs?)")
            seen.setdefault(name, (members, dump["rank"]))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _need(v: Any, kind: type, where: str) -> Any:
    ok = _is_int(v) if kind is int else isinstance(v, kind)
    if not ok:
        raise UserError(f"{where}: expected {kind.__name__}, found {type(v).__name__} (not an hfreduce trace dump?)")
    return v


def _field(obj: dict, key: str, kind: type, where: str) -> Any:
    if key not in obj:
        raise UserError(f"{where}: missing field {key!r} (not an hfreduce trace dump?)")
    return _need(obj[key], kind, f"{where}: field {key!r}")


# ---------------------------------------------------------------------- analysis
def analyse(dumps: list[dict], folder: str = "") -> dict:
    """The diagnosis, as plain data (what ``--json`` prints)."""
    names: dict[str, dict] = {}
    for dump in dumps:
        for name, g in dump["groups"].items():
            names.setdefault(name, g)
    warnings = []
    jobs = sorted({str(d.get("job")) for d in dumps})
    if len(jobs) > 1:
        warnings.append(f"the dumps come from different jobs ({', '.join(jobs)}): a folder reused across runs?")
    return {
        "dir": str(folder),
        "dumps": [{k: d.get(k) for k in ("rank", "hostname", "pid", "job", "reason", "dumped_at_ns", "file")}
                  for d in sorted(dumps, key=lambda d: d["rank"])],
        "groups": [_group(name, names[name], dumps) for name in sorted(names, key=_group_order)],
        "warnings": warnings,
    }


def _group_order(name: str) -> tuple:
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def _group(name: str, info: dict, dumps: list[dict]) -> dict:
    members: list[int] = info["global_ranks"]
    by_rank = {d["rank"]: d for d in dumps if name in d["groups"]}
    missing = [r for r in members if r not in by_rank]
    seqs: dict[int, dict[int, dict]] = {}  # rank -> seq -> entry
    for r, d in by_rank.items():
        seqs[r] = {e["collective_seq_id"]: e for e in d["entries"]
                   if e["process_group"][0] == name and not e.get("is_p2p")}
    every = sorted({s for es in seqs.values() for s in es})
    span = {r: (min(es), max(es)) if es else None for r, es in seqs.items()}

    def state(r: int, s: int) -> str:
        e = seqs[r].get(s)
        if e is not None:
            return "failed" if e.get("error") else e["state"]
        if span[r] is None or s > span[r][1]:
            return "not reached"
        return "aged out" if s < span[r][0] else "not recorded"

    first = next((s for s in every if any(state(r, s) not in _DONE for r in by_rank)), None)
    out: dict[str, Any] = {
        "name": name, "desc": info.get("desc", ""), "world_size": len(members), "ranks": members,
        "dumped": sorted(by_rank), "missing": missing, "first_incomplete": None, "waited_for": [],
        "wait_cycle": [], "mismatches": _mismatches(seqs, every), "p2p_pending": [],
    }
    if first is None:
        out["p2p_pending"] = _p2p_pending(name, members, by_rank)
        if out["p2p_pending"]:
            out["waited_for"], out["wait_cycle"] = _waited_for(_p2p_rows(members, by_rank, out["p2p_pending"]))
        return out

    rows = []
    sample = None
    for r in members:
        if r not in by_rank:
            rows.append({"rank": r, "state": "no dump", "waiting_on": [], "waiting_for": None, "error": None,
                         "seconds": None, "last_completed": None})
            continue
        st = state(r, first)
        e = seqs[r].get(first)
        sample = sample or e
        done = [s for s, x in seqs[r].items() if x["state"] == "completed"]
        row = {"rank": r, "state": st, "waiting_on": [], "waiting_for": None, "error": None, "seconds": None,
               "last_completed": max(done) if done else None}
        if e is not None:
            row["waiting_on"] = sorted(e.get("waiting_on_global") or [])
            row["waiting_for"] = e.get("waiting_for")
            row["error"] = e.get("error")
            since = e.get("waiting_since_ns") or e.get("time_discovered_started_ns") or e.get("time_created_ns")
            if since and st not in _DONE:
                row["seconds"] = round(max(0, by_rank[r]["dumped_at_ns"] - since) / 1e9, 3)
        rows.append(row)
    out["first_incomplete"] = {"seq": first, **_signature_dict(sample), "ranks": rows}
    out["waited_for"], out["wait_cycle"] = _waited_for(rows)
    return out


def _p2p_pending(name: str, members: list[int], by_rank: dict[int, dict]) -> list[dict]:
    """The sends and receives of group ``name`` that did not complete, per dumped rank (peers as global ranks)."""
    pending = []
    for r in sorted(by_rank):
        for e in by_rank[r]["entries"]:
            if e["process_group"][0] != name or not e.get("is_p2p") or e["state"] == "completed":
                continue
            peer = e.get("peer")
            pending.append({"rank": r, "op": e["op"], "peer": members[peer] if _is_int(peer) and
                            0 <= peer < len(members) else None, "state": "failed" if e.get("error") else e["state"],
                            "error": e.get("error")})
    return pending


def _p2p_rows(members: list[int], by_rank: dict[int, dict], pending: list[dict]) -> list[dict]:
    """Rows as :func:`_waited_for` reads them: each rank waits on the peers of its pending sends and receives."""
    rows = []
    for r in members:
        peers = sorted({p["peer"] for p in pending if p["rank"] == r and p["peer"] is not None})
        state = "no dump" if r not in by_rank else "started" if peers else "completed"
        rows.append({"rank": r, "state": state, "waiting_on": peers, "last_completed": None, "error": None})
    return rows


def _waited_for(rows: list[dict]) -> tuple[list[dict], list[int]]:
    """Follow who waits on whom at the stuck collective to where the waits end.

    A rank waited on that waits on no one itself (dead, never got there, done) is where a
    chain ends. When no rank recorded whom it waited on, the suspects are the ranks that
    did not start the collective. If the waits only go round in a cycle, there is no end.
    """
    by_rank = {row["rank"]: row for row in rows}
    edges = {row["rank"]: [w for w in row["waiting_on"] if w != row["rank"]]
             for row in rows if row["state"] not in _DONE and row["waiting_on"]}
    waited_by: dict[int, set[int]] = {}
    for r, ws in edges.items():
        for w in ws:
            waited_by.setdefault(w, set()).add(r)
    if not edges:
        ends = [row["rank"] for row in rows if row["state"] in ("no dump", "not reached", "scheduled")]
        return [_suspect(by_rank.get(r), r, []) for r in ends], []
    reach: set[int] = set()
    todo = [w for ws in edges.values() for w in ws]
    while todo:
        r = todo.pop()
        if r not in reach:
            reach.add(r)
            todo.extend(edges.get(r, []))
    ends = sorted(r for r in reach if r not in edges)
    late = ("no dump", "not reached", "scheduled")
    behind = [row["rank"] for row in rows if row["state"] in late]
    if behind and not any(by_rank[r]["state"] in late for r in ends if r in by_rank):
        # The live ranks' waits go round among themselves (each waits on a neighbour that is
        # itself stuck, or relays for the late one) while some rank left no dump at all or never
        # reached the collective: that rank is the suspect, not a cycle.
        return [_suspect(by_rank.get(r), r, sorted(waited_by.get(r, ()))) for r in behind], []
    cycle = [] if ends else sorted(reach)
    return [_suspect(by_rank.get(r), r, sorted(waited_by.get(r, ()))) for r in ends], cycle


def _suspect(row: dict | None, rank: int, waited_by: list[int]) -> dict:
    state = row["state"] if row else "not in group"
    why = {
        "no dump": "no dump (dead, or hung outside hfreduce)",
        "not reached": "never reached this collective"
        + (f"; last completed #{row['last_completed']}" if row and row["last_completed"] is not None else ""),
        "scheduled": "queued it but never started it",
        "started": "started it and waited on no one: stuck on that rank itself",
        "failed": "failed it" + (f": {row['error']}" if row and row["error"] else ""),
        "completed": "completed it, yet others still waited on it",
        "aged out": "had moved past it",
    }.get(state, state)
    return {"rank": rank, "state": state, "why": why, "waited_on_by": waited_by}


def _signature(e: dict) -> tuple:
    return (e["op"], str(e["input_sizes"]), str(e["input_dtypes"]), str(e["output_sizes"]), str(e["output_dtypes"]))


def _signature_dict(e: dict | None) -> dict:
    if e is None:
        return {"op": None, "input_sizes": None, "input_dtypes": None, "output_sizes": None, "output_dtypes": None}
    return {k: e[k] for k in ("op", "input_sizes", "input_dtypes", "output_sizes", "output_dtypes")}


def _mismatches(seqs: dict[int, dict[int, dict]], every: list[int]) -> list[dict]:
    found = []
    for s in every:
        variants: dict[tuple, list[int]] = {}
        sample: dict[tuple, dict] = {}
        for r in sorted(seqs):
            e = seqs[r].get(s)
            if e is not None:
                sig = _signature(e)
                variants.setdefault(sig, []).append(r)
                sample.setdefault(sig, e)
        if len(variants) > 1:
            order = sorted(variants, key=lambda sig: (len(variants[sig]), variants[sig][0]))  # the odd one out first
            found.append({"seq": s, "variants": [{"ranks": variants[sig], **_signature_dict(sample[sig])}
                                                 for sig in order]})
    return found


# ---------------------------------------------------------------------- text
def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    rs = sorted(ranks)
    parts = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(parts)


def _who(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + _ranges(ranks)


def _call(v: dict) -> str:
    def dtypes(ds: list) -> str:
        return ",".join(sorted(set(ds))) or "-"
    text = f"{v['op']} in {v['input_sizes']} {dtypes(v['input_dtypes'])}"
    if (v["output_sizes"], v["output_dtypes"]) != (v["input_sizes"], v["input_dtypes"]):
        text += f" -> out {v['output_sizes']} {dtypes(v['output_dtypes'])}"
    return text


def _clock(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


def render(a: dict) -> list[tuple[str, str]]:
    """The report as (line, style) pairs; the style is for a terminal, plain text ignores it."""
    lines: list[tuple[str, str]] = []
    dumps = a["dumps"]
    times = [d["dumped_at_ns"] for d in dumps]
    span = _clock(min(times)) + (f" to {_clock(max(times))}" if max(times) - min(times) >= 1e9 else "")
    lines.append((f"hfreduce flight recorder: {plural(len(dumps), 'dump')} in {a['dir']}, written {span}", "bold"))
    reasons: dict[str, list[int]] = {}
    for d in dumps:
        reasons.setdefault(d["reason"], []).append(d["rank"])
    for reason, ranks in sorted(reasons.items(), key=lambda kv: kv[1][0]):
        lines.append((f"  {_who(ranks)} dumped because: {reason}", ""))
    for w in a["warnings"]:
        lines.append((f"  warning: {w}", "yellow"))
    for g in a["groups"]:
        lines.append(("", ""))
        desc = f" ({g['desc']})" if g["desc"] else ""
        size = f"{g['world_size']} rank" + ("s" if g["world_size"] != 1 else "")
        head = f"group {g['name']}{desc}: {size} ({_ranges(g['ranks'])}), dumps from {_who(g['dumped'])}"
        if g["missing"]:
            head += f"; MISSING {_who(g['missing'])}: no dump (dead, or hung outside hfreduce)"
            lines.append((head, "bold red"))
        else:
            lines.append((head, "bold"))
        fi = g["first_incomplete"]
        if fi is None and g["p2p_pending"]:
            lines.append(("  every dumped rank completed every collective it recorded; sends and receives still "
                          "pending:", "bold"))
            for p in g["p2p_pending"][:_ROW_CAP]:
                way = "to" if p["op"] == "send" else "from"
                error = f"; error: {p['error']}" if p["error"] else ""
                lines.append((f"    rank {p['rank']:<7} {p['op']} {way} rank {p['peer']}: {p['state']}{error}", ""))
            if len(g["p2p_pending"]) > _ROW_CAP:
                lines.append((f"    ... and {len(g['p2p_pending']) - _ROW_CAP} more (--json lists them)", ""))
            lead = "everyone waited for" if len(g["waited_for"]) == 1 else "the waits end at"
            for s in g["waited_for"]:
                by = f"; waited on directly by {_who(s['waited_on_by'])}" if s["waited_on_by"] else ""
                lines.append((f"  => {lead} rank {s['rank']}: {s['why']}{by}", "bold red"))
        elif fi is None:
            lines.append(("  every dumped rank completed every collective it recorded", "green"))
            if g["missing"]:
                lines.append((f"  look at {_who(g['missing'])}: its log, or whether its process still exists",
                              "bold red"))
        else:
            lines.append((f"  first collective not completed everywhere: #{fi['seq']} "
                          + (_call(fi) if fi["op"] else ""), "bold"))
            shown, hidden = _row_groups(fi["ranks"])
            for ranks, row in shown:
                lines.append((f"    {_who(ranks):<12} {_row_text(row)}", "red" if row["state"] == "no dump" else ""))
            if hidden:
                lines.append((f"    ... and {_who(hidden)} started, each waiting on another rank (--json lists them)", ""))
            lead = "everyone waited for" if len(g["waited_for"]) == 1 else "the waits end at"
            for s in g["waited_for"]:
                by = f"; waited on directly by {_who(s['waited_on_by'])}" if s["waited_on_by"] else ""
                lines.append((f"  => {lead} rank {s['rank']}: {s['why']}{by}", "bold red"))
            if g["wait_cycle"]:
                lines.append((f"  => {_who(g['wait_cycle'])} wait on each other in a cycle: no rank is late, "
                              "the ranks disagree on what to do (see mismatches)", "bold red"))
        for m in g["mismatches"][:_MISMATCH_CAP]:
            parts = " | ".join(f"{_who(v['ranks'])}: {_call(v)}" for v in m["variants"])
            lines.append((f"  MISMATCH at #{m['seq']}: {parts}", "bold red"))
        if len(g["mismatches"]) > _MISMATCH_CAP:
            lines.append((f"  ... and {len(g['mismatches']) - _MISMATCH_CAP} more mismatches (see --json)", "red"))
    lines.append(("", ""))
    lines.append((f"torch's analyzer reads the same dumps: python -m torch.distributed.flight_recorder.fr_trace "
                  f"{a['dir']} --allow-incomplete-ranks", "dim"))
    return lines


def _row_groups(rows: list[dict], cap: int = _ROW_CAP) -> tuple[list[tuple[list[int], dict]], list[int]]:
    """Consecutive ranks in the same situation, as one line; past ``cap`` lines, the plain waiters are summed up."""
    out: list[tuple[list[int], dict]] = []
    for row in rows:
        key = (row["state"], row["waiting_on"], row["waiting_for"], row["error"], row["last_completed"])
        if out and out[-1][1]["_key"] == key:
            out[-1][0].append(row["rank"])
            out[-1][1]["_secs"].append(row["seconds"])
        else:
            out.append(([row["rank"]], {**row, "_key": key, "_secs": [row["seconds"]]}))
    if len(out) <= cap:
        return out, []
    plain = [i for i, (_, row) in enumerate(out) if row["state"] == "started" and row["waiting_on"] and not row["error"]]
    drop = set(plain[max(0, cap - (len(out) - len(plain))):])
    return [g for i, g in enumerate(out) if i not in drop], sorted(r for i in drop for r in out[i][0])


def _row_text(row: dict) -> str:
    text = row["state"]
    if row["state"] == "not reached" and row["last_completed"] is not None:
        text += f" (last completed #{row['last_completed']})"
    if row["waiting_on"]:
        text += f", waiting on {_who(row['waiting_on'])}"
        if row["waiting_for"]:
            text += f" for {row['waiting_for']}"
    secs = [s for s in row["_secs"] if s is not None]
    if secs:
        lo, hi = min(secs), max(secs)
        text += f" ({lo:.1f} s)" if hi - lo < 0.05 else f" ({lo:.1f}-{hi:.1f} s)"
    if row["error"]:
        text += f"; error: {row['error']}"
    return text


# ---------------------------------------------------------------------- command
def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="fireflyer hfreduce trace", description=doc_summary(__doc__))
    p.add_argument("dir", metavar="DIR", help=f"the folder of the dumps (${DIR_ENV})")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    args = p.parse_args(argv)
    analysis = analyse(load(args.dir), args.dir)
    if args.json:
        print(json.dumps(analysis, indent=1))
        return 0
    lines = render(analysis)
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.text import Text

        console = Console(highlight=False)
        for text, style in lines:
            console.print(Text(text, style=style or ""), soft_wrap=True)
    else:
        print("\n".join(text for text, _ in lines))
    return 0
