"""bench_rows - scripts/bench's table: a row per scenario from its record and the limits the run
measured (pure: what `scripts/bench --replay` prints again without a GPU). scripts/bench imports
it (and its test through scripts/bench)."""
import json
import os
import re
import shutil
import subprocess

from bench_read import *  # noqa: F401,F403 (decode_per_token_ms and the other readers)

SCENARIOS = ("S1", "S2", "S3", "Q1", "Q2", "Q3", "P1", "P2", "P3", "M1", "M2", "MX1", "MX2", "M1R", "M2R", "CHECK", "K1",
             "K2", "D1", "B1", "B2")  # the table's order
B_CONCURRENCY = (1, 4, 16, 32)  # B1, B2: streamed requests at once


# ---------------------------------------------------------------------------------------------
# The table's rows, from a scenario's record and the limits (pure)
# ---------------------------------------------------------------------------------------------


def row(*cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"


def limits_line(lim):
    line = (f"H2D {round(lim['h2d_bytes_per_s'] / 1e9, 1)} GB/s pinned, "
            f"HBM {round(lim['hbm_bytes_per_s'] / 1e12, 2)} TB/s read, "
            f"disk {round(lim['disk_bytes_per_s'] / 1e9, 2)} GB/s O_DIRECT, "
            f"bf16 GEMM {round(lim['gemm_flops_per_s'] / 1e12)} TFLOP/s")
    # bench-limits --h2d-shapes (a split scenario ran): the P rows' down shares as the 2D copies the
    # window makes of them, against the same bytes in one copy.
    shares = [s for s in lim.get("h2d_2d", []) if s.get("what", "").startswith("P")]
    if shares:
        line += "; down's GPU share as a 2D copy: " + ", ".join(
            f"{s['what'].split(' down')[0]} {s['bytes_per_s'] / 1e9:.1f} GB/s "
            f"({s['width']} of {s['pitch']} bytes a row; {s['contiguous_bytes_per_s'] / 1e9:.1f} in one copy)"
            for s in shares)
    return line


def rows_s1(rec, lim):
    if rec.get("failed"):
        return [row("S1", "failed (see logs)", "-", "-", "-")]
    g, w = rec["gen"], rec["weights"]
    np_, pre, dec = g["prompt_tokens"], g["prefill_ms"], decode_total_ms(g)
    streamed, copy_ms = rec["streamed_bytes_per_token"], rec["copy_ms"]
    h2d, gemm = lim["h2d_bytes_per_s"], lim["gemm_flops_per_s"]
    ms_tok = decode_per_token_ms(g)
    limit = streamed / h2d * 1e3
    pre_limit = max(streamed / h2d, 2 * w["matrix_params"] * np_ / gemm) * 1e3
    idle = max(0.0, 1 - copy_ms / dec) if streamed > 0 else 0.0
    return [
        f"| S1 decode (8B, --gpu-budget 6GiB) | {ms_tok:.1f} ms/token | {limit:.1f} ms/token ({streamed/1e9:.2f} GB/token at {h2d/1e9:.1f} GB/s) | {ms_tok/limit:.3f} | <= 1.10 and <= 210 ms |",
        f"| S1 prefill 512 | {pre:.0f} ms ({np_/pre*1e3:.0f} tok/s) | {pre_limit:.0f} ms | {pre/pre_limit:.3f} | <= 1.15 |",
        f"| overlap: H2D idle during decode | {idle*100:.1f}% | - | - | < 5% |",
    ]


def tok_s(ms_tok):
    return f"{1e3 / ms_tok:.1f} tok/s"


def rows_resident(name, what, target, rate=False):
    """A decode with every weight resident: every byte a token reads (checkpoint_weights), once, at
    the HBM read rate measured in the run."""
    def rows(rec, lim):
        if rec.get("failed"):
            return [row(name, "failed (see logs)", "-", "-", "-")]
        ms_tok = decode_per_token_ms(rec["gen"])
        per_tok, hbm = rec["weights"]["bytes_per_token"], lim["hbm_bytes_per_s"]
        bound = per_tok / hbm * 1e3
        measured = f"{ms_tok:.2f} ms/token" + (f" ({tok_s(ms_tok)})" if rate else "")
        st, said = rec.get("step_times") or {}, what
        if st.get("steps_timed") and st.get("gaps"):
            said += (f"; the engine's decode steps {st['in_steps_ms'] / st['steps_timed']:.3f} ms each, the host "
                     f"between two {st['between_steps_ms'] / st['gaps']:.3f}")
        return [f"| {name} decode ({said}) | {measured} | {bound:.2f} ms/token ({per_tok/1e9:.2f} GB/token at "
                f"{hbm/1e12:.2f} TB/s HBM) | {ms_tok/bound:.2f} | {target} |"]
    return rows


rows_s2 = rows_resident("S2", "8B, all resident", "<= 8 ms/token")
rows_q1 = rows_resident("Q1", "8B Q4_K_M, --gpu-budget 6GiB, all resident", "<= 1.5", rate=True)


def rows_q2(rec, lim):
    """Q8_0 streamed: the planned PCIe limit of what the window streams per token."""
    if rec.get("failed"):
        return [row("Q2", "failed (see logs)", "-", "-", "-")]
    ms_tok = decode_per_token_ms(rec["gen"])
    streamed, h2d = rec["streamed_bytes_per_token"], lim["h2d_bytes_per_s"]
    limit = streamed / h2d * 1e3
    s1 = rec.get("s1_streamed_bytes_per_token")
    beside = f"; S1 (bf16) streams {s1/1e9:.2f} GB/token" if s1 else ""
    return [
        f"| Q2 decode (8B Q8_0, --gpu-budget 4GiB, streams) | {ms_tok:.1f} ms/token ({tok_s(ms_tok)}) | {limit:.1f} ms/token ({streamed/1e9:.2f} GB/token at {h2d/1e9:.1f} GB/s{beside}) | {ms_tok/limit:.3f} | <= 1.10 |"
    ]


def rows_q3(rec, lim):
    """70B layers Q4_K_M: the binding limit is the larger of the streamed bytes over PCIe and
    every byte read once from HBM."""
    if rec.get("failed"):
        return [row("Q3", "failed (see logs)", "-", "-", "-")]
    ms_tok = decode_per_token_ms(rec["gen"])
    streamed, per_tok = rec["streamed_bytes_per_token"], rec["weights"]["bytes_per_token"]
    h2d, hbm = lim["h2d_bytes_per_s"], lim["hbm_bytes_per_s"]
    pcie, mem = streamed / h2d * 1e3, per_tok / hbm * 1e3
    limit = max(pcie, mem)
    which = (f"{streamed/1e9:.2f} GB/token streamed at {h2d/1e9:.1f} GB/s" if pcie >= mem else
             f"{per_tok/1e9:.2f} GB/token at {hbm/1e12:.2f} TB/s HBM")
    return [
        f"| Q3 decode (70B x16 layers Q4_K_M, GPU 8GiB, DRAM 12GiB) | {ms_tok:.1f} ms/token ({tok_s(ms_tok)}) | {limit:.1f} ms/token ({which}) | {ms_tok/limit:.3f} | - |"
    ]


def strict_row(label, violations):
    return row(label, "no violation" if violations == 0 else f"{violations} violation lines", "-", "-", "none")


def rows_s3(rec, lim):
    if rec.get("failed"):
        return [row("S3", "failed (see logs)", "-", "-", "-")]
    ms_tok = decode_per_token_ms(rec["gen"])
    per_tok, disk = rec["disk_bytes_per_token"], lim["disk_bytes_per_s"]
    limit = per_tok / disk * 1e3
    return [
        strict_row("--strict S3", rec["strict_violations"]),
        f"| S3 decode (70B x16 layers, GPU 8GiB, DRAM 12GiB) | {ms_tok:.0f} ms/token | {limit:.0f} ms/token ({per_tok/1e9:.1f} GB/token from disk at {disk/1e9:.2f} GB/s) | {ms_tok/limit:.3f} | <= 1.15 |",
    ]


def rows_check(rec, lim):
    out = []
    for tool in ("memcheck", "racecheck"):
        summary = rec.get("sanitizers", {}).get(tool)
        if summary is None:
            out.append(row(f"compute-sanitizer {tool}", "failed (see logs)", "-", "-", "0 errors"))
        else:
            out.append(row(f"compute-sanitizer {tool} (small S1, streaming)", summary or "no summary (see log)",
                           "-", "-", "0 errors"))
    if rec.get("strict_violations") is None:
        out.append(row("--strict S1", "failed (see logs)", "-", "-", "none"))
    else:
        out.append(strict_row("--strict S1 (8 tokens)", rec["strict_violations"]))
    return out


def rows_k1(rec, lim):
    """Decode at a 32K context against the weight time (the same instance at a short context)
    plus the KV bytes fetched per decode token over H2D. Fetched blocks: f0 after the cold
    prefill, f1 after a one-token request (its prefill from the store), f2 after knew more
    tokens: what decode fetched is (f2 - f1) - (f1 - f0)."""
    if rec.get("failed"):
        return [row("K1", "failed (see logs)", "-", "-", "-")]
    h2d, knew, bb = lim["h2d_bytes_per_s"], rec["new_tokens"], rec["kv_block_bytes"]
    f0, f1, f2 = rec["fetched"]
    weight_ms = decode_per_token_ms(rec["short"])
    ms_tok = decode_per_token_ms(rec["long"])
    per_tok = ((f2 - f1) - (f1 - f0)) / knew * bb
    limit = weight_ms + per_tok / h2d * 1e3
    return [
        f"| K1 decode (8B resident, context 32K, --kv-gpu-budget 1GiB) | {ms_tok:.1f} ms/token | {limit:.1f} ms/token ({weight_ms:.1f} ms weights + {per_tok/1e9:.2f} GB KV/token at {h2d/1e9:.1f} GB/s) | {ms_tok/limit:.3f} | <= 1.15 |"
    ]


def rows_k2(rec, lim):
    if rec.get("failed"):
        return [row("K2", "failed (see logs)", "-", "-", "-")]
    cold, warm = rec["cold"]["prefill_ms"], rec["warm"]["prefill_ms"]
    wall_cold, wall_warm = rec["wall_cold_ms"], rec["wall_warm_ms"]
    return [
        f"| K2 first token, 8K-token shared prefix (8B) | cold {cold:.0f} ms, warm {warm:.1f} ms (client wall {wall_cold:.0f} / {wall_warm:.0f} ms; {rec.get('kv_prefix_positions')} positions restored, {rec.get('kv_prefix_blocks_on_gpu')} blocks still on the GPU) | - | {cold/warm:.1f}x sooner | >= 10x |"
    ]


# The warm-up request's tokens: fewer than the runner's re-plan of the CPU share from its jobs needs
# (SPLIT_REPLAN_MIN_TOKENS, split_plan.h), so the measured request runs the plan made at start; more
# than two: on an H200 the first tokens after start ran at a quarter of the speed of later ones
# (P3: 65 ms a token over a 2-token warm-up, 28 in the measured request, 18 on a later instance).
WARMUP_TOKENS = 8


def replanned(rec):
    """What a P row says of the rates its split was planned with, and of the memory its split freed
    that the GPU kept more groups with (gw_split_refill)."""
    said = "; planned anew at the jobs' rate" if rec.get("rates_from_jobs") else ""
    g = rec.get("gen") or {}
    total = decode_total_ms(g) if "decode_total_ms" in g or "generated_tokens" in g else 0
    if total > 0 and rec.get("copy_ms"):
        per = decode_per_token_ms(rec["gen"]) / total
        said += (f"; the link busy {rec['copy_ms'] / total * 100:.0f}%, compute waited for copies "
                 f"{rec.get('copy_wait_ms', 0) * per:.1f} ms/token")
    if rec.get("refill_bytes"):
        said += f"; {rec['refill_bytes'] / 2**20:.0f} MiB more kept on the GPU with the memory the split frees"
    if rec.get("spread"):
        said += "; the kept layers spread among the layers"
    return said


def p_limit(sp, wh, lim):
    """A split run's limit: the unsplit run's streamed bytes over the rates its runner measured at
    once (H2D beside the CPU, at most H2D alone, + the CPU beside the copies)."""
    h2d = min(sp.get("h2d_beside_cpu_bytes_per_s") or lim["h2d_bytes_per_s"], lim["h2d_bytes_per_s"])
    return wh["streamed_bytes_per_token"] / (h2d + sp["cpu_bytes_per_s"]) * 1e3


def p_median(rec, lim, name):
    """--repeat: of the split's instances that ran, the one whose ratio to its own limit is the
    median (the lower middle of an even count), and a row that gives them all; without repeats the
    split and no row."""
    runs = [r for r in rec.get("repeats") or [] if not r.get("failed")]
    if len(runs) < 2:
        return rec["split"], []
    wh = rec["whole"]
    ratios = sorted((decode_per_token_ms(r["gen"]) / p_limit(r, wh, lim), i) for i, r in enumerate(runs))
    mid = ratios[(len(ratios) - 1) // 2]
    failed = len(rec["repeats"]) - len(runs)
    said = ", ".join(f"{decode_per_token_ms(runs[i]['gen']):.1f} ms ({q:.3f}; job {runs[i]['cpu_share']['cpu_job_us']:.0f} us)"
                     for q, i in ratios)
    return runs[mid[1]], [row(f"{name}, the split on {len(rec['repeats'])} instances of its own, by ratio"
                              + (f" ({failed} failed)" if failed else ""), said, "each its own",
                              f"median {mid[0]:.3f}", "<= 1.10")]


HANDOFF_BUCKETS = ("<50", "50-100", "100-200", "200-500", "500-1000", ">=1000")


def handoff_detail(cs):
    """The handoffs by size (the split FFNs timed on the stream, their job's time subtracted), the
    pool's start after a dispatch and its time without a job between two: "" where the runner does
    not report them."""
    hist = cs.get("handoff_hist")
    if not hist or not sum(hist):
        return ""
    by = "/".join(str(n) for n in hist)
    return (f" (by size in us {'/'.join(HANDOFF_BUCKETS)}: {by}); the pool starts a job "
            f"{cs.get('dispatch_us', 0):.0f} us after its dispatch (at most {cs.get('dispatch_max_us', 0):.0f}) "
            f"and waits {cs.get('gap_us', 0):.0f} us between two"
            + (f"; the dispatcher off its CPU {cs['dispatch_stalls']} times, {cs.get('dispatch_stall_ms', 0):.1f} ms"
               if cs.get("dispatch_stalls") else "")
            + (f"; {cs['dispatched_by_wait']} jobs handed over by the runner's waiting thread"
               if cs.get("dispatched_by_wait") else "")
            + (f"; {cs['dispatched_by_workers']} by the pool's idle workers"
               if cs.get("dispatched_by_workers") else "")
            + (f"; {cs['prefetched_mb'] / max(cs.get('jobs', 1), 1):.1f} MB of each job read ahead"
               if cs.get("prefetched_mb") else ""))


def gaps_counted(sp):
    """The GPU's work between split layers that auto counted on the copies' side (--split-gaps)."""
    ms = sp.get("split_gaps_ms") or 0
    return f"; the GPU's work between split layers, {ms:.1f} ms/token, counted on the link's side" if ms > 0 else ""


def rows_p(name, what):
    def rows(rec, lim):
        if rec.get("failed") or rec["split"].get("failed") or rec["whole"].get("failed"):
            return [row(name, "failed (see logs)", "-", "-", "-")]
        wh = rec["whole"]
        sp, spread_rows = p_median(rec, lim, name)
        ms_split, ms_whole = decode_per_token_ms(sp["gen"]), decode_per_token_ms(wh["gen"])
        # The CPU and the copies read the same DRAM: the runner measures the CPU's rate beside H2D
        # copies and the copies' rate beside the CPU, at once (gpu_window_split.c); that sum is what
        # the two move together. H2D alone (bench-limits) + the CPU is the row's second limit.
        h2d_alone, cpu = lim["h2d_bytes_per_s"], sp["cpu_bytes_per_s"]
        h2d = min(sp.get("h2d_beside_cpu_bytes_per_s") or h2d_alone, h2d_alone)  # as the runner plans
        limit = p_limit(sp, wh, lim)
        limit_alone = wh["streamed_bytes_per_token"] / (h2d_alone + cpu) * 1e3
        cs = sp["cpu_share"]
        return [
            f"| {name} decode ({what}, --cpu-share auto: {cs['split_ffns']} FFNs split at r {cs['r_min']}..{cs['r_max']} of {cs['ffn_dim']}, {sp['cpu_bytes_per_token']/1e9:.2f} GB/token on the CPU, {sp['streamed_bytes_per_token']/1e9:.2f} over PCIe; job {cs['cpu_job_us']:.0f} us, handoff {cs['handoff_us']:.0f} us, {cs['handoff']}{handoff_detail(cs)}{gaps_counted(sp)}{replanned(sp)}) | {ms_split:.1f} ms/token | {limit:.1f} ms/token ({wh['streamed_bytes_per_token']/1e9:.2f} GB/token at {h2d/1e9:.1f} GB/s H2D beside the CPU + {cpu/1e9:.1f} GB/s CPU beside the copies, measured at once; with H2D alone, {h2d_alone/1e9:.1f} GB/s: {limit_alone:.1f} ms, {ms_split/limit_alone:.3f}) | {ms_split/limit:.3f} | <= 1.10 |",
            f"| {name} speed-up over --cpu-share 0 (same instance shape: {ms_whole:.1f} ms/token) | {ms_whole/ms_split:.2f}x | - | - | >= 1.8x |",
        ] + spread_rows + rows_p_copy(name, rec.get("copy"), limit) + rows_p_alt(name, rec.get("token"), wh, lim) + \
            rows_p_alt(name, rec.get("first"), wh, lim, "--window-spread=no (the kept layers the first ones)") + \
            rows_p_alt(name, rec.get("fixed"), wh, lim, "--fixed-residency (the memory the split frees unused)")
    return rows


def rows_p_alt(name, ly, wh, lim, flag="--cpu-share-balance token"):
    """--ab: the split with one CPU share for every FFN (--cpu-share-balance token), with the kept
    layer groups the first layers rather than spread among them (--window-spread=no; spread is what
    auto does where FFNs split), or with the memory the split frees left unused (--fixed-residency),
    against its own run's limit (its rates measured at once, as the split's row)."""
    if ly is None:
        return []
    if ly.get("failed"):
        return [row(f"{name} decode, {flag}", "failed (see logs)", "-", "-", "-")]
    h2d = min(ly.get("h2d_beside_cpu_bytes_per_s") or lim["h2d_bytes_per_s"], lim["h2d_bytes_per_s"])
    limit = wh["streamed_bytes_per_token"] / (h2d + ly["cpu_bytes_per_s"]) * 1e3
    cs, ms = ly["cpu_share"], decode_per_token_ms(ly["gen"])
    return [f"| {name} decode, the same with {flag} (r {cs['r_min']}..{cs['r_max']}, "
            f"{ly['cpu_bytes_per_token']/1e9:.2f} GB/token on the CPU, {ly['streamed_bytes_per_token']/1e9:.2f} over "
            f"PCIe; job {cs['cpu_job_us']:.0f} us, handoff {cs['handoff_us']:.0f} us{replanned(ly)}) | {ms:.1f} ms/token | "
            f"{limit:.1f} ms/token ({h2d/1e9:.1f} + {ly['cpu_bytes_per_s']/1e9:.1f} GB/s) | {ms/limit:.3f} | <= 1.10 |"]


def rows_p_copy(name, cp, limit):
    """--ab: the same split with the CPU's results copied up (--cpu-result copy) instead of read
    from mapped host memory."""
    if cp is None:
        return []
    if cp.get("failed"):
        return [row(f"{name} decode, --cpu-result copy", "failed (see logs)", "-", "-", "-")]
    cs, ms = cp["cpu_share"], decode_per_token_ms(cp["gen"])
    return [f"| {name} decode, the same with --cpu-result copy (job {cs['cpu_job_us']:.0f} us, handoff "
            f"{cs['handoff_us']:.0f} us) | {ms:.1f} ms/token | {limit:.1f} ms/token | {ms/limit:.3f} | - |"]


def active_bytes(w):
    """Bytes of the parameters one decode token reads (checkpoint_weights): bytes_per_token but
    the experts a token does not choose (num_experts_per_tok of num_experts)."""
    e, k, expert = w["experts"], w["experts_used"], w["expert_bytes"]
    return w["bytes_per_token"] - expert + (expert * k / e if e else 0)


def host_profile_report(prof, addr2line="addr2line"):
    """The runner's host profile (stats: host_profile) by function: each sampled address named by
    addr2line in its module (static functions too), samples summed per function, most first, as
    lines "samples  share  function  module". Addresses addr2line cannot name keep the exported
    symbol the runner found, or module+offset."""
    top, total = prof.get("top") or [], prof.get("samples") or 0
    names = {}
    by_module = {}
    for module, off, _sym, _n in top:
        by_module.setdefault(module, []).append(off)
    for module, offs in by_module.items():
        if not os.path.isfile(module) or not shutil.which(addr2line):
            continue
        out = subprocess.run([addr2line, "-f", "-C", "-e", module, *offs], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True).stdout.splitlines()
        for i, off in enumerate(offs):
            fn = out[2 * i] if 2 * i < len(out) else "??"
            if fn and fn != "??":
                names[(module, off)] = fn
    sums = {}
    for module, off, sym, n in top:
        fn = names.get((module, off)) or sym or off
        key = (fn, os.path.basename(module))
        sums[key] = sums.get(key, 0) + n
    lines = [f"{n:7d}  {100 * n / total if total else 0:5.1f}%  {fn}  ({mod})\n"
             for (fn, mod), n in sorted(sums.items(), key=lambda kv: -kv[1])]
    listed = sum(sums.values())
    return (f"{total} samples of the runner's thread's CPU time; {listed} at the {len(top)} addresses listed\n"
            + "".join(lines))


def rows_mres(name, what):
    """A mixture-of-experts model all resident: the bytes of the active parameters (the experts a
    token chooses, not all of them) once, at the HBM rate."""
    def rows(rec, lim):
        if rec.get("failed"):
            return [row(name, "failed (see logs)", "-", "-", "-")]
        ms_tok = decode_per_token_ms(rec["gen"])
        act, hbm = active_bytes(rec["weights"]), lim["hbm_bytes_per_s"]
        bound = act / hbm * 1e3
        beside = ""
        for key, how in (("host", "routed on the host (--moe-host-route)"),
                         ("apart", "each expert launched on its own (--experts-apart)")):
            other = rec.get(key) or {}
            if other.get("gen"):
                beside += f"; {how}: {decode_per_token_ms(other['gen']):.2f} ms/token"
            elif other.get("failed"):
                beside += f"; {how.split(' (')[0]} failed (see logs)"
        return [f"| {name} decode ({what}, --gpu-budget 40GiB, all resident{beside}) | {ms_tok:.2f} ms/token "
                f"({tok_s(ms_tok)}) | {bound:.2f} ms/token ({act/1e9:.2f} GB/token of active parameters at "
                f"{hbm/1e12:.2f} TB/s HBM) | {ms_tok/bound:.2f} | - |"]
    return rows


def rows_d1(rec, lim):
    """Two ranks: each streams its layers' share over its own link (the rate its runner measured).
    Both links busy at once would take the larger of the two times (the two-link limit); at batch 1
    the ranks compute one after the other, and a rank's link is busy during the other's turn only
    while its window has slots to fill: that bound is the sum."""
    if rec.get("failed"):
        return [row("D1", "failed (see logs)", "-", "-", "-")]
    ms_tok = decode_per_token_ms(rec["gen"])
    ranks = rec["ranks"]
    times = [r["streamed_bytes_per_token"] / r["h2d_bytes_per_s"] * 1e3 for r in ranks]
    two_link, serial = max(times), sum(times)
    # During the other rank's turn a link fills its window's slots (its next groups) and no more.
    credited = sum(max(0.0, r["streamed_bytes_per_token"] - r["window_bytes"]) / r["h2d_bytes_per_s"] * 1e3
                   for r in ranks)
    parts = "; ".join(f"rank {i} layers {r['layer0']}..{r['layer1'] - 1}: {r['streamed_bytes_per_token']/1e9:.2f} "
                      f"GB/token at {r['h2d_bytes_per_s']/1e9:.1f} GB/s, window {r['window_bytes']/2**30:.2f} GiB"
                      for i, r in enumerate(ranks))
    s1 = rec.get("s1_ms_per_token")
    same = rec.get("tokens_equal_s1")
    out = [
        f"| D1 decode (8B bf16, --gpus 0,1, --gpu-budget 3GiB each, {rec.get('link', '?')} link; {parts}) | "
        f"{ms_tok:.1f} ms/token | {two_link:.1f} ms/token (two-link: both links at once) | {ms_tok/two_link:.3f} | - |",
        f"| D1 against the ranks one after the other (batch 1) | {ms_tok:.1f} ms/token | {serial:.1f} ms/token "
        f"(the sum of the ranks' copy times) | {ms_tok/serial:.3f} | - |",
        f"| D1 against the batch-1 limit (one after the other, each window's slots filled during the other's "
        f"turn) | {ms_tok:.1f} ms/token | {credited:.1f} ms/token | {ms_tok/credited:.3f} | - |",
    ]
    if s1:
        out.append(f"| D1 against S1 (6GiB on one GPU: {s1:.1f} ms/token) | {s1/ms_tok:.2f}x | - | - | - |")
    if same is not None:
        out.append(f"| D1 greedy tokens against S1's | {same} | - | - | all |")
    return out


def rows_m1_variant(rec, key, flag, lim_split, name, said="", host_time=True, spans=False):
    """--ab: the split run again with a flag (record key `key`), a row beside the default's: its bytes on
    the CPU and copied, the host's time for the CPU's experts (host_time), their layers' spans and the
    parts idle between a job's phases (spans), against the same limit."""
    rt = rec.get(key)
    if rt is None:
        return []
    if rt.get("failed"):
        return [row(f"{name} decode, {flag}", "failed (see logs)", "-", "-", "-")]
    ms = decode_per_token_ms(rt["gen"])
    host = f"; the host's time for the CPU's experts {rt.get('cpu_experts_ms_per_token', 0):.1f} ms" if host_time else ""
    if spans and rt.get("cpu_experts_span_ms_per_token"):
        host += (f"; their layers' spans {rt['cpu_experts_span_ms_per_token']:.1f} ms, parts idle between phases "
                 f"{rt.get('cpu_phase_wait_ms_per_token', 0):.1f} ms")
    return [f"| {name} decode, the same with {flag} ({said}{rt['cpu_expert_bytes_per_token']/1e9:.2f} GB/token on the "
            f"CPU, {rt['decode_h2d_bytes_per_token']/1e9:.2f} copied{host}) | {ms:.1f} ms/token | {lim_split:.1f} ms/token | "
            f"{ms/lim_split:.2f} | <= 1.2 |"]


def rows_m1_ab(rec, lim_split, name):
    """--ab's M rows: the CPU's experts handed to the pool at their visit (the default hands them over at
    the route; records from before that default ran "route"); a layer's experts copied only after its
    route (--predict-experts=false; the default copies the GPU's share of a later layer's experts on its
    last routing); the host waiting for a token's CPU experts at the layer's end and copying their sum up
    (--cpu-result copy; by default the stream waits for them and a kernel reads their rows); the CPU's
    expert jobs in equal chunks (--cpu-expert-chunks equal; by default they taper); each expert the GPU
    keeps launched on its own (--experts-apart; by default a layer's go in two launches); the CPU's experts
    weighed at the start's calibrated rate (--fixed-split; by default at the rate their spans ran at, and
    the guesses give the copies their lead)."""
    mode = "visit" if "visit" in rec else "route"
    return (rows_m1_variant(rec, mode, f"--cpu-experts {mode}", lim_split, name) +
            rows_m1_variant(rec, "nopredict", "--predict-experts=false", lim_split, name, host_time=False) +
            rows_m1_variant(rec, "hostwait", "--cpu-result copy", lim_split, name,
                            said="the host waits for the CPU's experts; ") +
            rows_m1_variant(rec, "equal", "--cpu-expert-chunks equal", lim_split, name,
                            said="the CPU's expert jobs in equal chunks; ", spans=True) +
            rows_m1_variant(rec, "apart", "--experts-apart", lim_split, name,
                            said="each kept expert launched on its own; ") +
            rows_m1_variant(rec, "startrate", "--fixed-split", lim_split, name,
                            said="the CPU's experts weighed at the calibrated rate; ", spans=True))


def window_by(rec):
    """' (route 0.1, skip 0.2, ...; copies' calls 0.3, polls 0.1)': the window's host time a token by
    call, where the record has it ("" where not)."""
    by = rec.get("window_host_by_per_token")
    if not by:
        return ""
    calls = ", ".join(f"{k.replace('_', ' ')} {by[k]:.2f}" for k in ("route", "skip", "acquire", "release", "acquire_host")
                      if k in by)
    return f" ({calls}; of them the copies' calls {by.get('copy_calls', 0):.2f}, polls {by.get('poll', 0):.2f})"


def rows_m1_prefill(gp, lim, name, shape):
    """The measured request's prefill (512 tokens, one chunk, no prefix restored; --cpu-share 0: a
    chunk's experts stream to the GPU) against the larger of its copies (the bytes it moved over
    H2D) and its compute (2 x the matrix parameters a token reads, per token, at the bf16 GEMM
    rate)."""
    g = gp["gen"]
    if "prefill_h2d_bytes" not in gp or not g.get("prefill_ms"):
        return []
    n, ms = g["prompt_tokens"], float(g["prefill_ms"])
    copy_ms = gp["prefill_h2d_bytes"] / lim["h2d_bytes_per_s"] * 1e3
    w = gp["weights"]
    active_params = w["matrix_params"] * active_bytes(w) / w["bytes_per_token"]  # bytes a parameter alike
    comp_ms = 2 * n * active_params / lim["gemm_flops_per_s"] * 1e3
    bound = max(copy_ms, comp_ms)
    what = "its copies" if copy_ms >= comp_ms else "its compute"
    return [f"| {name} prefill {n} ({shape}, --cpu-share 0; {gp['prefill_h2d_bytes']/1e9:.2f} GB copied) | "
            f"{ms:.0f} ms ({n / ms * 1e3:.0f} tok/s) | {bound:.0f} ms ({what}: {copy_ms:.0f} ms at "
            f"{lim['h2d_bytes_per_s']/1e9:.1f} GB/s H2D, compute {comp_ms:.1f} ms) | {ms / bound:.2f} | - |"]


EXPERTS_ALONE_K = 4  # the experts a layer bench-cpu-gemv runs for the M rows (the CPU's share of top-8)
EXPERTS_ALONE_POOL_BYTES = 2 << 30  # ... drawn from a pool this large, past any CPU cache (as the ring's)
MIXTRAL_EXPERT = (14336, 4096)  # Mixtral-8x7B's expert: gate and up 14336 rows of 4096, down 4096 of 14336


def expert_bytes(fmt, rows=768, cols=2048):
    """Bytes of one expert's three matrices of rows x cols (down cols x rows) in fmt, as bench-cpu-gemv
    makes them (BF16, or Q4_K's 144-byte blocks of 256 values); 0 for another format."""
    if fmt == "BF16":
        return 3 * rows * cols * 2
    if fmt == "Q4_K":
        return 2 * rows * (cols // 256 * 144) + cols * (rows // 256 * 144)
    return 0


def experts_alone_pool(fmt, rows=768, cols=2048):
    """How many experts bench-cpu-gemv --experts draws from for the M rows: EXPERTS_ALONE_POOL_BYTES
    of them (at least its default 32), so that the layers' experts come from DRAM as in the runner."""
    b = expert_bytes(fmt, rows, cols)
    return max(32, -(-EXPERTS_ALONE_POOL_BYTES // b)) if b else 32


def parse_experts_alone(out):
    """bench-cpu-gemv --experts' line -> {"ms": a layer's span median, "gbs": its GB/s, "wait_pct": the
    workers' time parts waited between phases}, or None."""
    m = re.search(r"span median ([0-9.]+) ms \(([0-9.]+) GB/s\).*?([0-9.]+)% of the workers' time", out)
    if not m:
        return None
    return {"ms": float(m.group(1)), "gbs": float(m.group(2)), "wait_pct": float(m.group(3))}


def rows_m1_alone(rec, name, fmt):
    """The CPU's experts alone beside the M rows (experts_alone), where the record has them."""
    a = rec.get("experts_alone") or {}
    d = a.get("default")
    if not d:
        return []
    other = "; ".join(f"{said} {a[k]['ms']:.3f} ms ({a[k]['gbs']:.1f} GB/s, {a[k]['wait_pct']:.1f}%)"
                      for k, said in (("spin", "waiting parts spinning"), ("equal", "equal chunks")) if k in a)
    pool = f", {a['pool']} to choose from" if a.get("pool") else ""
    return [f"| {name}, the CPU's experts alone (bench-cpu-gemv --experts {a.get('k', EXPERTS_ALONE_K)}: "
            f"{a.get('rows', 768)} x {a.get('cols', 2048)} "
            f"{fmt}{pool}, {a.get('threads', '?')} workers; a layer's span median, and the parts' time waiting between "
            f"phases{'; ' + other if other else ''}) | {d['ms']:.3f} ms ({d['gbs']:.1f} GB/s, {d['wait_pct']:.1f}%) "
            f"| - | - | - |"]


def rows_m1(rec, lim, name="M1", shape="bf16", fmt="bf16", model="Qwen3-30B-A3B shape x24 layers", budget="4GiB"):
    gp, sp = rec.get("gpu", {}), rec.get("split", {})
    sb = sp.get("step_begin_ms") or {}  # a step's first routing after one (scripts/bench)
    if rec.get("failed") or gp.get("failed") or sp.get("failed"):
        return [row(name, "failed (see logs)", "-", "-", "-")]
    h2d, cpu = lim["h2d_bytes_per_s"], rec["cpu_bytes_per_s"]
    ms_g, ms_s = decode_per_token_ms(gp["gen"]), decode_per_token_ms(sp["gen"])
    dec = gp["decode_h2d_bytes_per_token"]
    lim_h2d = dec / h2d * 1e3
    lim_both = dec / (h2d + cpu) * 1e3
    w = gp["weights"]
    # The CPU and the copies read the same DRAM: as P1-P3, the split row's limit takes the rates the
    # runner measured at once, each beside the other, where it has them; each alone is the second.
    hb, cb = sp.get("h2d_beside_cpu_bytes_per_s") or 0, sp.get("cpu_beside_bytes_per_s") or 0
    lim_split = lim_both
    said = f"{h2d/1e9:.1f} GB/s H2D + {cpu/1e9:.1f} GB/s CPU {fmt} GEMV"
    if hb > 0 and cb > 0:
        lim_split = dec / (min(hb, h2d) + cb) * 1e3
        said = (f"{min(hb, h2d)/1e9:.1f} GB/s H2D beside the CPU + {cb/1e9:.1f} GB/s CPU beside the copies, measured "
                f"at once; each alone, {h2d/1e9:.1f} + {cpu/1e9:.1f} GB/s {fmt} GEMV: {lim_both:.1f} ms, "
                f"{ms_s/lim_both:.2f}")
    # With --profile-copies, the same bytes at the rates the decode itself ran at: the link over its
    # timed copies, the CPU over its spans (the start's calibration moves 10-20% between instances).
    lr = (sp["decode_h2d_bytes_per_token"] / sp["decode_copy_ms_per_token"] * 1e3
          if sp.get("decode_copy_ms_per_token") else 0)
    cr = (sp["cpu_experts_span_bytes_per_token"] / sp["cpu_experts_span_ms_per_token"] * 1e3
          if sp.get("cpu_experts_span_ms_per_token") and sp.get("cpu_experts_span_bytes_per_token") else 0)
    if lr > 0 and cr > 0:
        lim_ran = dec / (lr + cr) * 1e3
        said += (f"; at the rates the decode ran at, {lr/1e9:.1f} GB/s over the timed copies + {cr/1e9:.1f} over "
                 f"the CPU's spans: {lim_ran:.1f} ms, {ms_s/lim_ran:.2f}")
    return [
        f"| {name} decode, routed experts copied ({model} {shape}, --gpu-budget {budget}, --cpu-share 0; "
        f"{dec/1e9:.2f} GB/token copied of {active_bytes(w)/1e9:.2f} GB of active parameters, "
        f"{gp['experts_passed_per_token']:.0f} expert groups passed over per token; {gp.get('experts_resident', 0)} "
        f"experts resident, {100 * gp.get('experts_resident_routing', 0):.1f}% of the routing, "
        f"{gp.get('expert_replans', 0)} re-plan; the window's calls {gp.get('window_host_ms_per_token', 0):.1f} ms/token "
        f"on the host{window_by(gp)}) against its H2D bytes | "
        f"{ms_g:.1f} ms/token | {lim_h2d:.1f} ms/token ({h2d/1e9:.1f} GB/s H2D) | {ms_g/lim_h2d:.2f} | - |",
        f"| {name} decode, routed experts shared with the CPU (--cpu-share auto: {sp['cpu_expert_bytes_per_token']/1e9:.2f} "
        f"GB/token on the CPU, the host's time submitting and waiting for them {sp.get('cpu_experts_ms_per_token', 0):.1f} ms"
        + (f", their layers' spans (first submitted to last done) {sp['cpu_experts_span_ms_per_token']:.1f} ms"
           if sp.get("cpu_experts_span_ms_per_token") else "")
        + (f" ({sp['cpu_experts_span_bytes_per_token'] / sp['cpu_experts_span_ms_per_token'] / 1e6:.1f} GB/s)"
           if sp.get("cpu_experts_span_ms_per_token") and sp.get("cpu_experts_span_bytes_per_token") else "")
        + ((f", the routes weighing them at {sp['expert_rate_from_spans_before'] / 1e9:.1f} GB/s as the request "
            f"began and {sp['expert_rate_from_spans'] / 1e9:.1f} as it ended (their spans' rate, folded in)"
            if sp.get("expert_rate_from_spans_before") else
            f", the routes weighing them at {sp['expert_rate_from_spans'] / 1e9:.1f} GB/s (their spans before)")
           + (f" and the guesses giving the copies a lead of {sp['expert_lead_ms'] * 1e3:.0f} us a layer"
              if sp.get("expert_lead_ms") else "")
           if sp.get("expert_rate_from_spans") else "")
        + (f", the layers' ends as measured: the GPU's side last by {sp.get('ends_gpu_late_ms_per_token', 0):.2f} ms a "
           f"token, the CPU's by {sp.get('ends_cpu_late_ms_per_token', 0):.2f} ({sp['ends_measured_per_token']:.1f} "
           f"layers a token), the routes' lag for it {sp.get('ends_lag_ms_before', 0) * 1e3:.0f} -> "
           f"{sp.get('ends_lag_ms', 0) * 1e3:.0f} us"
           if sp.get("ends_measured_per_token") else "")
        + (f", their parts idle between a job's phases {sp['cpu_phase_wait_ms_per_token']:.1f} ms summed over workers"
           if sp.get("cpu_phase_wait_ms_per_token") else "")
        + (f", the gaps from a layer's last to the next one's first {sp['cpu_gap_gpu_ms_per_token']:.1f} ms to the "
           f"routing's return and {sp.get('cpu_gap_host_ms_per_token', 0):.1f} ms on the host"
           if sp.get("cpu_gap_gpu_ms_per_token") else "")
        + (f", from a token's last to the next token's first {sp['cpu_step_gap_ms_per_token']:.1f} ms"
           + (f" (to the step's return {sp['cpu_step_tail_ms_per_token']:.2f}; from it, the host to the first "
              f"router's launch {sb.get('host', 0):.2f} and its wait for the routing {sb.get('wait', 0):.2f}; on "
              f"the GPU's clock the embedding's end {sb.get('gpu_embed', 0):.3f}, then the router's start "
              f"{sb.get('gpu_attn', 0):.3f}, the router {sb.get('gpu_router', 0):.3f}"
              + ("; the step's start on the host by part, " +
                 ", ".join(f"{k} {v:.3f}" for k, v in sp["begin_parts_ms"].items())
                 if sp.get("begin_parts_ms") else "") + ")"
              if sp.get("cpu_step_tail_ms_per_token") else "")
           + (f" (the host's between two steps {sp['host_between_steps_ms']:.2f})"
              if sp.get("host_between_steps_ms") else "")
           if sp.get("cpu_step_gap_ms_per_token") else "")
        + ", "
        f"{sp['decode_h2d_bytes_per_token']/1e9:.2f} copied"
        + (f" (the link busy {sp['decode_copy_ms_per_token']:.1f} ms a token with them, "
           f"{sp['decode_h2d_bytes_per_token'] / sp['decode_copy_ms_per_token'] / 1e6:.1f} GB/s: --profile-copies)"
           if sp.get("decode_copy_ms_per_token") else "")
        + "; the host waited "
        f"{sp.get('route_wait_ms_per_token', 0):.1f} ms/token for routings, its window's calls took "
        f"{sp.get('window_host_ms_per_token', 0):.1f}" + window_by(sp)
        + (f"; {sp['guessed_per_token']:.1f} experts a token copied on a guess, {sp.get('guess_hits_per_token', 0):.1f} "
           f"of them chosen" if sp.get("guessed_per_token") else "")
        + (f", {sp['expert_depth']} slots for the streamed experts" if sp.get("expert_depth") else "")
        + (f", {sp['split_per_token']:.1f} experts a token split between the copies and the CPU"
           if sp.get("split_per_token") else "")
        + f") against the same bytes over "
        f"H2D + CPU | {ms_s:.1f} ms/token | {lim_split:.1f} ms/token ({said}) | {ms_s/lim_split:.2f} | <= 1.2 |",
    ] + rows_m1_ab(rec, lim_split, name) + rows_m1_alone(rec, name, fmt) + rows_m1_prefill(gp, lim, name, shape) + [
        row(f"{name} decode, --cpu-share {f} (fixed)", "failed (see logs)", "-", "-", "-") if fx.get("failed") else
        f"| {name} decode, --cpu-share {f} (fixed: {fx['cpu_expert_bytes_per_token']/1e9:.2f} GB/token on the CPU, the "
        f"host's time for them {fx.get('cpu_experts_ms_per_token', 0):.1f} ms, {fx['decode_h2d_bytes_per_token']/1e9:.2f} copied) | "
        f"{decode_per_token_ms(fx['gen']):.1f} ms/token | {lim_split:.1f} ms/token | "
        f"{decode_per_token_ms(fx['gen'])/lim_split:.2f} | - |"
        for f, fx in sorted(rec.get("fixed", {}).items())
    ]


ROWS = {"S1": rows_s1, "D1": rows_d1, "S2": rows_s2, "S3": rows_s3, "Q1": rows_q1, "Q2": rows_q2, "Q3": rows_q3, "CHECK": rows_check,
        "K1": rows_k1, "K2": rows_k2, "P1": rows_p("P1", "8B bf16, --gpu-budget 6GiB"),
        "P2": rows_p("P2", "70B layer shape x16 bf16, GPU 8GiB, DRAM 40GiB"),
        "P3": rows_p("P3", "8B Q8_0, --gpu-budget 6GiB"), "M1": rows_m1,
        "M2": lambda rec, lim: rows_m1(rec, lim, "M2", "Q4_K_M", "Q4_K"),
        "MX1": lambda rec, lim: rows_m1(rec, lim, "MX1", "bf16", "bf16", "Mixtral-8x7B shape x8 layers", "8GiB"),
        "MX2": lambda rec, lim: rows_m1(rec, lim, "MX2", "Q4_K_M", "Q4_K", "Mixtral-8x7B shape x16 layers", "8GiB"),
        "M1R": rows_mres("M1R", "Qwen3-30B-A3B shape x24 layers bf16"),
        "M2R": rows_mres("M2R", "Qwen3-30B-A3B shape x24 layers Q4_K_M")}


def rows_b(name, what):
    def rows(rec, lim):
        if rec.get("failed"):
            return [row(name, "failed (see the logs)", "-", "-", "-")]
        out = []
        one = rec["levels"][0]["tokens_per_s"] if rec["levels"] else 0.0
        bound = rec.get("bound_tok_s")  # B2: one request's rate at the HBM bound
        for lv in rec["levels"]:
            c, tps = lv["concurrency"], lv["tokens_per_s"]
            speed = tps / one if one > 0 else 0.0
            target = ">= 12x the single rate" if c == 16 else "-"
            if bound:
                limit = f"{bound * c:.1f} tok/s ({c} x the HBM-bound rate {bound:.1f})"
                ratio = f"{bound * c / tps:.2f}" if tps > 0 else "-"
            else:
                limit = f"{speed:.1f}x the single request's {one:.1f} tok/s"
                ratio = "-"
            errs = f"; {lv['streams'] - lv['ok']} failed" if lv["ok"] < lv["streams"] else ""
            out.append(row(f"{name} {what}, {c} at once", f"{tps:.1f} tok/s, TTFT p50 {lv['ttft_p50_s'] * 1e3:.0f} ms"
                           f" (max {lv['ttft_max_s'] * 1e3:.0f}){errs}", limit, ratio, target))
        return out
    return rows


ROWS.update(B1=rows_b("B1", "8B bf16 over HTTP, --gpu-budget 6GiB (streamed)"),
            B2=rows_b("B2", "8B bf16 over HTTP, all resident"))


def table(title, lim, rows):
    head = [title, f"limits measured in this run: {limits_line(lim)}", "",
            "| scenario | measured | limit | ratio | target |", "| --- | --- | --- | --- | --- |"]
    return "\n".join(head + rows) + "\n"


def replay(results, wanted):
    """The table from a results folder, as the run that wrote it printed it (but its title)."""
    with open(os.path.join(results, "limits.json")) as f:
        lim = json.load(f)
    rows = []
    for name in SCENARIOS:
        path = os.path.join(results, f"{name}.record.json")
        if name in wanted and os.path.exists(path):
            with open(path) as f:
                rows += ROWS[name](json.load(f), lim)
    return table(f"bench replay of {results}", lim, rows)
