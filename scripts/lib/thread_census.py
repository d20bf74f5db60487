"""thread_census - every thread of the host before and after a measured request, from /proc: the CPU
time each used in between, how often the scheduler took its CPU from it (involuntary switches), and
the CPU it last ran on. It tells whether the CPU share's workers and the handoff's dispatcher were
preempted during a decode, and by which threads of which processes.

    before = snapshot()
    ... the measured request ...
    text, summary = report(before, snapshot())

A snapshot reads /proc/PID/task/TID/{stat,status} of every process; threads that end or start
between the two snapshots are counted from what one of them saw (a new thread from zero).
"""
import os

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

# The runner's threads whose preemption delays a split FFN or a layer's CPU experts (task_pool.c
# names its workers taskpool-N; cpu_handoff.cu its dispatcher cpu-handoff).
WORKER_PREFIX = "taskpool-"
DISPATCHER = "cpu-handoff"


def _read(path):
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def parse_stat(text):
    """(comm, utime + stime in ticks, last CPU) from a /proc/.../stat line, or None. The name may
    hold spaces and parentheses: it ends at the last ')'."""
    if not text:
        return None
    a, b = text.find("("), text.rfind(")")
    if a < 0 or b < a:
        return None
    rest = text[b + 2:].split()
    # rest[0] is field 3 (state); utime 14, stime 15, processor 39 (1-based in proc(5)).
    if len(rest) < 37:
        return None
    try:
        return text[a + 1:b], int(rest[11]) + int(rest[12]), int(rest[36])
    except ValueError:
        return None


def parse_switches(text):
    """(voluntary, involuntary) context switches from a /proc/.../status text (0, 0 if absent)."""
    vol = invol = 0
    for line in (text or "").splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            vol = int(line.split()[1])
        elif line.startswith("nonvoluntary_ctxt_switches:"):
            invol = int(line.split()[1])
    return vol, invol


def snapshot(proc="/proc"):
    """tid -> {pid, proc, name, ticks, cpu, vol, invol} for every thread readable under proc."""
    out = {}
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        pstat = parse_stat(_read(f"{proc}/{pid}/stat"))
        if not pstat:
            continue
        try:
            tids = os.listdir(f"{proc}/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            st = parse_stat(_read(f"{proc}/{pid}/task/{tid}/stat"))
            if not st:
                continue
            vol, invol = parse_switches(_read(f"{proc}/{pid}/task/{tid}/status"))
            out[int(tid)] = {"pid": int(pid), "proc": pstat[0], "name": st[0], "ticks": st[1], "cpu": st[2],
                             "vol": vol, "invol": invol}
    return out


def deltas(before, after):
    """Per thread seen after: its CPU ms, involuntary and voluntary switches since before (a thread
    not seen before counts from zero), process and thread names, last CPU."""
    rows = []
    for tid, a in after.items():
        b = before.get(tid)
        if b and b["pid"] != a["pid"]:
            b = None  # the tid was reused
        ms = (a["ticks"] - (b["ticks"] if b else 0)) * 1000.0 / CLK_TCK
        invol = a["invol"] - (b["invol"] if b else 0)
        vol = a["vol"] - (b["vol"] if b else 0)
        rows.append({"tid": tid, "pid": a["pid"], "proc": a["proc"], "name": a["name"], "cpu_ms": ms,
                     "invol": invol, "vol": vol, "cpu": a["cpu"]})
    return rows


def is_worker(r):
    return r["name"].startswith(WORKER_PREFIX)


def report(before, after, top=20):
    """(text, summary): the threads that used CPU time or were preempted between the snapshots, the
    most CPU first (top of them, and every worker and dispatcher); summary counts the pool's
    workers' and the dispatcher's involuntary switches and the CPU time of every other thread."""
    rows = deltas(before, after)
    workers = [r for r in rows if is_worker(r)]
    disp = [r for r in rows if r["name"] == DISPATCHER]
    worker_pids = {r["pid"] for r in workers + disp}
    others = [r for r in rows if not is_worker(r) and r["name"] != DISPATCHER and (r["cpu_ms"] > 0 or r["invol"] > 0)]
    others.sort(key=lambda r: (-r["cpu_ms"], -r["invol"]))
    summary = {
        "workers": len(workers),
        "worker_invol": sum(r["invol"] for r in workers),
        "workers_preempted": sum(1 for r in workers if r["invol"] > 0),
        "dispatcher_invol": sum(r["invol"] for r in disp),
        "others_cpu_ms": round(sum(r["cpu_ms"] for r in others), 1),
        "runner_others_cpu_ms": round(sum(r["cpu_ms"] for r in others if r["pid"] in worker_pids), 1),
        "top_others": [f"{r['proc']}/{r['name']} {r['cpu_ms']:.0f} ms" for r in others[:3]],
    }
    lines = ["thread census: CPU time and involuntary switches between the two snapshots",
             f"{'process':<16} {'thread':<16} {'tid':>8} {'cpu ms':>9} {'invol':>7} {'vol':>8} {'last cpu':>8}"]

    def line(r):
        return (f"{r['proc'][:16]:<16} {r['name'][:16]:<16} {r['tid']:>8} {r['cpu_ms']:>9.0f} {r['invol']:>7} "
                f"{r['vol']:>8} {r['cpu']:>8}")
    for r in sorted(workers + disp, key=lambda r: (r["name"] != DISPATCHER, r["name"])):
        lines.append(line(r))
    if others:
        lines.append("-- other threads, most CPU first --")
        lines.extend(line(r) for r in others[:top])
        if len(others) > top:
            lines.append(f"... {len(others) - top} more, {sum(r['cpu_ms'] for r in others[top:]):.0f} ms in all")
    return "\n".join(lines) + "\n", summary


def summary_text(s):
    """One line for the bench's log."""
    if not s["workers"]:
        return f"no pool workers; other threads {s['others_cpu_ms']:.0f} ms of CPU ({', '.join(s['top_others'])})"
    return (f"{s['workers_preempted']} of {s['workers']} workers preempted, {s['worker_invol']} times; the dispatcher "
            f"{s['dispatcher_invol']} times; other threads {s['others_cpu_ms']:.0f} ms of CPU, the runner's "
            f"{s['runner_others_cpu_ms']:.0f} ({', '.join(s['top_others'])})")
