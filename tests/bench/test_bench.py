#!/usr/bin/env python3
"""test_bench - the parts of scripts/bench that need no GPU: the statistics parser, the
checkpoint reader (against make-synthetic-model where the build has it), the log readers, the
command line, and the table from a recorded results folder (sample/).

sample/ holds limits.json and SCENARIO.record.json files as a run writes them; expected-table.md
is the table `scripts/bench --replay sample` must print after its title. Its S1, S3, K1 and K2 rows
are what the bash version of scripts/bench printed for the same numbers (its decode_ms being the
decode loop's total, as pipectl prints it: here decode_ms x (generated_tokens - 1)).

    python3 -B tests/bench/test_bench.py        (ctest: bench_script, label unit)
"""
import importlib.machinery
import importlib.util
import json
import os
import struct
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.environ.get("PIPELINE_SOURCE_DIR", os.path.dirname(os.path.dirname(HERE)))
SCRIPT = os.path.join(SOURCE, "scripts", "bench")
SAMPLE = os.path.join(HERE, "sample")

sys.dont_write_bytecode = True
_loader = importlib.machinery.SourceFileLoader("bench", SCRIPT)
_spec = importlib.util.spec_from_loader("bench", _loader)
bench = importlib.util.module_from_spec(_spec)
_loader.exec_module(bench)


def write_safetensors(path, tensors):
    """tensors: name -> (shape, bytes per element); the data is zeros."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (shape, esize) in tensors.items():
        n = esize
        for d in shape:
            n *= d
        header[name] = {"dtype": "BF16" if esize == 2 else "F32", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + bytes(offset))


def llama_tensors(vocab, dim, layers, ffn, kv_dim, tied):
    t = {"model.embed_tokens.weight": ([vocab, dim], 2), "model.norm.weight": ([dim], 2)}
    if not tied:
        t["lm_head.weight"] = ([vocab, dim], 2)
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": ([dim, dim], 2), p + "self_attn.k_proj.weight": ([kv_dim, dim], 2),
                  p + "self_attn.v_proj.weight": ([kv_dim, dim], 2), p + "self_attn.o_proj.weight": ([dim, dim], 2),
                  p + "mlp.gate_proj.weight": ([ffn, dim], 2), p + "mlp.up_proj.weight": ([ffn, dim], 2),
                  p + "mlp.down_proj.weight": ([dim, ffn], 2), p + "input_layernorm.weight": ([dim], 2),
                  p + "post_attention_layernorm.weight": ([dim], 2)})
    return t


def config_params(c):
    """The parameter count a Llama config.json implies (lm_head when untied)."""
    d, hd = c["hidden_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv, f = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd, c["intermediate_size"]
    layer = d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d
    heads = 1 if c.get("tie_word_embeddings") else 2
    return heads * c["vocab_size"] * d + c["num_hidden_layers"] * layer + d


class GenStats(unittest.TestCase):
    def test_object_on_stderr(self):
        err = "warming up\n" + json.dumps({"prompt_tokens": 512, "prefill_ms": 192.3, "prefill_tok_s": 2662.5,
                                            "tokens_generated": 4, "reason": "length", "decode_ms": 557.7,
                                            "decode_tok_s": 7.2, "total_ms": 760.0}) + "\n"
        g = bench.parse_gen_stats(err)
        self.assertEqual(g["prompt_tokens"], 512)
        self.assertEqual(g["generated_tokens"], 4)
        self.assertAlmostEqual(bench.decode_per_token_ms(g), 185.9)
        self.assertAlmostEqual(bench.decode_total_ms(g), 557.7)

    def test_total_when_given(self):
        g = {"prompt_tokens": 1, "prefill_ms": 1, "generated_tokens": 5, "decode_ms": 2.0, "decode_total_ms": 8.5}
        self.assertEqual(bench.decode_total_ms(g), 8.5)

    def test_text_holding_braces(self):
        # Text output may hold a "{": the last line that is a whole object counts.
        out = "a {b} {\n{\"prompt_tokens\": 3, \"prefill_ms\": 1.5, \"tokens_generated\": 2, \"decode_ms\": 4}\n"
        self.assertEqual(bench.parse_gen_stats(out)["decode_ms"], 4)

    def test_missing_key(self):
        with self.assertRaisesRegex(bench.BenchError, "decode_ms"):
            bench.parse_gen_stats('1 2\n{"prompt_tokens": 3, "prefill_ms": 1.5, "tokens_generated": 2}\n')

    def test_not_a_number(self):
        with self.assertRaisesRegex(bench.BenchError, "prefill_ms"):
            bench.parse_gen_stats('{"prompt_tokens": 3, "prefill_ms": "1.5", "tokens_generated": 2, "decode_ms": 1}')
        with self.assertRaisesRegex(bench.BenchError, "tokens_generated"):
            bench.parse_gen_stats('{"prompt_tokens": 3, "prefill_ms": 1, "tokens_generated": true, "decode_ms": 1}')

    def test_no_object(self):
        with self.assertRaisesRegex(bench.BenchError, "no statistics"):
            bench.parse_gen_stats("1 2 3\nprompt 3 tokens: prefill 1.0 ms\n")


class OutNames(unittest.TestCase):
    def test_second_run_does_not_overwrite(self):
        """A second bench in one device call writes table-2.md and bench-results-2.tar.gz, a third -3."""
        with tempfile.TemporaryDirectory() as out:
            first = bench.out_names(out)
            self.assertEqual(first, (os.path.join(out, "table.md"), os.path.join(out, "bench-results.tar.gz")))
            open(first[1], "w").close()
            second = bench.out_names(out)
            self.assertEqual(second, (os.path.join(out, "table-2.md"), os.path.join(out, "bench-results-2.tar.gz")))
            open(second[0], "w").close()
            self.assertEqual(bench.out_names(out)[0], os.path.join(out, "table-3.md"))


class ThreadCensus(unittest.TestCase):
    @staticmethod
    def stat_line(tid, name, ticks, cpu):
        # fields 3.. as proc(5) numbers them: state, ppid, ..., utime (14), stime (15), ..., processor (39)
        f = ["S"] + ["0"] * 40
        f[14 - 3], f[15 - 3], f[39 - 3] = str(ticks), "0", str(cpu)
        return f"{tid} ({name}) " + " ".join(f) + "\n"

    def write_proc(self, root, threads):
        """threads: (pid, proc name, tid, thread name, ticks, cpu, invol)."""
        for pid, pname, tid, tname, ticks, cpu, invol in threads:
            os.makedirs(os.path.join(root, str(pid), "task", str(tid)), exist_ok=True)
            with open(os.path.join(root, str(pid), "stat"), "w") as f:
                f.write(self.stat_line(pid, pname, 0, 0))
            with open(os.path.join(root, str(pid), "task", str(tid), "stat"), "w") as f:
                f.write(self.stat_line(tid, tname, ticks, cpu))
            with open(os.path.join(root, str(pid), "task", str(tid), "status"), "w") as f:
                f.write(f"Name:\t{tname}\nvoluntary_ctxt_switches:\t7\nnonvoluntary_ctxt_switches:\t{invol}\n")

    def test_name_with_parentheses(self):
        census = bench.thread_census
        self.assertEqual(census.parse_stat(self.stat_line(5, "a) (b", 12, 3)), ("a) (b", 12, 3))
        self.assertIsNone(census.parse_stat("5 (short) S 1 2\n"))
        self.assertIsNone(census.parse_stat(""))

    def test_preempted_workers_and_thieves(self):
        """Workers' and the dispatcher's involuntary switches are counted between the snapshots; the
        other threads are listed by the CPU time they took, the runner's own apart."""
        census = bench.thread_census
        tick = 1000.0 / census.CLK_TCK
        with tempfile.TemporaryDirectory() as before, tempfile.TemporaryDirectory() as after:
            self.write_proc(before, [(10, "gpu-runner", 11, "taskpool-0", 100, 2, 1),
                                     (10, "gpu-runner", 12, "taskpool-1", 100, 3, 4),
                                     (10, "gpu-runner", 13, "cpu-handoff", 50, 1, 0),
                                     (10, "gpu-runner", 14, "gpu-runner", 10, 0, 0),
                                     (20, "ssd-loader", 21, "ssd-loader", 5, 4, 0)])
            self.write_proc(after, [(10, "gpu-runner", 11, "taskpool-0", 300, 2, 1),
                                    (10, "gpu-runner", 12, "taskpool-1", 290, 3, 9),
                                    (10, "gpu-runner", 13, "cpu-handoff", 250, 1, 2),
                                    (10, "gpu-runner", 14, "gpu-runner", 40, 0, 0),
                                    (20, "ssd-loader", 21, "ssd-loader", 65, 4, 3),
                                    (30, "python3", 31, "python3", 2, 5, 0)])
            text, s = census.report(census.snapshot(before), census.snapshot(after))
        self.assertEqual((s["workers"], s["workers_preempted"], s["worker_invol"], s["dispatcher_invol"]), (2, 1, 5, 2))
        self.assertAlmostEqual(s["others_cpu_ms"], round((30 + 60 + 2) * tick, 1))
        self.assertAlmostEqual(s["runner_others_cpu_ms"], round(30 * tick, 1))
        self.assertTrue(s["top_others"][0].startswith("ssd-loader/ssd-loader"), s["top_others"])
        lines = text.splitlines()
        self.assertIn("cpu-handoff", lines[2])  # the dispatcher first, then the workers
        self.assertIn("taskpool-1", lines[4])
        self.assertRegex(lines[4], r"\s5\s+0\s+3$")  # 5 involuntary, 0 voluntary, last on CPU 3
        self.assertIn("1 of 2 workers preempted, 5 times; the dispatcher 2 times", census.summary_text(s))

    def test_this_process(self):
        """A real snapshot holds this thread, with a CPU time that does not go back."""
        census = bench.thread_census
        a = census.snapshot()
        self.assertIn(os.getpid(), a)
        sum(i * i for i in range(200000))
        b = census.snapshot()
        self.assertGreaterEqual(b[os.getpid()]["ticks"], a[os.getpid()]["ticks"])


class Checkpoint(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def write(self, tied, shards=2):
        t = llama_tensors(vocab=1000, dim=64, layers=3, ffn=128, kv_dim=32, tied=tied)
        names = sorted(t)
        for s in range(shards):
            write_safetensors(os.path.join(self.dir, f"model-{s + 1:05d}-of-{shards:05d}.safetensors"),
                              {n: t[n] for n in names[s::shards]})
        with open(os.path.join(self.dir, "config.json"), "w") as f:
            json.dump({"vocab_size": 1000, "tie_word_embeddings": tied}, f)
        return t

    def test_untied(self):
        self.write(tied=False)
        w = bench.checkpoint_weights(self.dir)
        layer = 64 * 64 * 2 + 32 * 64 * 2 + 3 * 128 * 64
        self.assertEqual(w["params"], 2 * 1000 * 64 + 3 * (layer + 2 * 64) + 64)
        self.assertEqual(w["matrix_params"], 1000 * 64 + 3 * layer)
        self.assertEqual(w["weight_bytes"], 2 * w["params"])
        # One embedding row, not the table.
        self.assertEqual(w["bytes_per_token"], w["weight_bytes"] - 2 * 1000 * 64 + 2 * 64)
        self.assertFalse(w["tied_embeddings"])
        self.assertEqual((w["files"], w["tensors"]), (2, 3 + 3 * 9))

    def test_tied(self):
        self.write(tied=True, shards=1)
        w = bench.checkpoint_weights(self.dir)
        layer = 64 * 64 * 2 + 32 * 64 * 2 + 3 * 128 * 64
        self.assertEqual(w["params"], 1000 * 64 + 3 * (layer + 2 * 64) + 64)
        self.assertEqual(w["matrix_params"], 1000 * 64 + 3 * layer)  # the embedding is the head
        self.assertEqual(w["bytes_per_token"], w["weight_bytes"])
        self.assertTrue(w["tied_embeddings"])

    def test_bad_header(self):
        self.write(tied=False, shards=1)
        with open(os.path.join(self.dir, "model-00001-of-00001.safetensors"), "wb") as f:
            f.write(b"\x01\x02")
        with self.assertRaises(bench.BenchError):
            bench.checkpoint_weights(self.dir)

    def test_synthetic_model(self):
        tool = os.path.join(os.environ.get("PIPELINE_BIN_DIR", ""), "make-synthetic-model")
        if not os.access(tool, os.X_OK):
            self.skipTest("make-synthetic-model not built (PIPELINE_BIN_DIR)")
        for extra in ([], ["--tied"]):
            out = os.path.join(self.dir, "m" + "".join(extra))
            said = subprocess.run([tool, "--shape", "tiny", "--shards", "2", "--out", out, "--quiet", *extra],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=True).stdout
            with open(os.path.join(out, "config.json")) as f:
                c = json.load(f)
            w = bench.checkpoint_weights(out)
            self.assertEqual(w["params"], config_params(c))
            self.assertIn(f" {w['params']} parameters", said)
            self.assertEqual(w["weight_bytes"], 2 * w["params"])


    def test_synthetic_gguf(self):
        """A GGUF file's bytes per token come from its header: the same parameters as the
        safetensors checkpoint of the same arguments, Q8_0 matrices at 34 bytes per 32 values,
        F32 norms; a split set reads as the one file."""
        tool = os.path.join(os.environ.get("PIPELINE_BIN_DIR", ""), "make-synthetic-model")
        if not os.access(tool, os.X_OK):
            self.skipTest("make-synthetic-model not built (PIPELINE_BIN_DIR)")
        st = os.path.join(self.dir, "st")
        subprocess.run([tool, "--shape", "tiny", "--out", st, "--quiet"], check=True, stdout=subprocess.DEVNULL)
        want = bench.checkpoint_weights(st)
        for shards in ("0", "2"):
            out = os.path.join(self.dir, f"g{shards}")
            subprocess.run([tool, "--shape", "tiny", "--format", "gguf", "--type", "q8_0", "--shards", shards,
                            "--out", out, "--quiet"], check=True, stdout=subprocess.DEVNULL)
            w = bench.checkpoint_weights(out)
            self.assertEqual(w["params"], want["params"])
            self.assertEqual(w["matrix_params"], want["matrix_params"])
            norms = 64 * (2 * 2 + 1)  # tiny: dim 64, 2 layers
            self.assertEqual(w["weight_bytes"], (w["params"] - norms) // 32 * 34 + 4 * norms)
            self.assertEqual(w["vocab_size"], 512)
            self.assertFalse(w["tied_embeddings"])


class Logs(unittest.TestCase):
    def test_strict(self):
        text = "x\n[err] --strict: group 3 late\nfine\n[err] --strict: again\n"
        self.assertEqual(bench.count_strict(text), 2)
        self.assertEqual(bench.count_strict(""), 0)

    def test_memcheck(self):
        text = "========= COMPUTE-SANITIZER\nsomething\n========= ERROR SUMMARY: 0 errors\n"
        self.assertEqual(bench.sanitizer_summary("memcheck", text), "ERROR SUMMARY: 0 errors")
        self.assertEqual(bench.sanitizer_summary("memcheck", "nothing"), "")

    def test_racecheck(self):
        text = ("========= Warning: Race reported between Write access at nvjet_sm90_x+0x10\n"
                "========= Warning: Race reported between Write access at attention_kernel+0x20\n"
                "========= Warning: Race reported between Read access at nvjet_sm90_y+0x30\n"
                "========= RACECHECK SUMMARY: 3 hazards displayed (0 errors, 3 warnings)\n")
        self.assertEqual(bench.sanitizer_summary("racecheck", text),
                         "RACECHECK SUMMARY: 3 hazards displayed (0 errors, 3 warnings); "
                         "hazards in the project's kernels: 1 (cuBLAS nvjet: 2)")
        self.assertEqual(bench.sanitizer_summary("racecheck", ""),
                         "no summary; hazards in the project's kernels: 0 (cuBLAS nvjet: 0)")


class Prompts(unittest.TestCase):
    def test_ids(self):
        self.assertEqual(bench.prompt_ids(3, 128256), [513, 8432, 16351])
        self.assertEqual(bench.spread_ids(2, 1), [8432, 16351])
        a, b = bench.k2_prompts()
        self.assertEqual((len(a), len(b)), (8256, 8256))
        self.assertEqual(a[:8192], b[:8192])
        self.assertNotEqual(a[8192:], b[8192:])


class Table(unittest.TestCase):
    def test_replay(self):
        got = bench.replay(SAMPLE, set(bench.SCENARIOS)).splitlines()
        with open(os.path.join(SAMPLE, "expected-table.md")) as f:
            want = f.read().splitlines()
        self.assertEqual(got[0], f"bench replay of {SAMPLE}")
        self.assertEqual(got[1:], want)

    def test_s2_bound_is_measured(self):
        with open(os.path.join(SAMPLE, "limits.json")) as f:
            lim = json.load(f)
        with open(os.path.join(SAMPLE, "S2.record.json")) as f:
            rec = json.load(f)
        one = bench.rows_s2(rec, lim)[0]
        lim["hbm_bytes_per_s"] /= 2
        half = bench.rows_s2(rec, lim)[0]
        self.assertIn("4.97 ms/token (15.01 GB/token at 3.02 TB/s HBM) | 1.47 |", one)
        self.assertIn("9.94 ms/token (15.01 GB/token at 1.51 TB/s HBM) | 0.74 |", half)

    def test_limits_line_shapes(self):
        # With bench-limits --h2d-shapes (a split scenario ran), the limits line gives the P rows'
        # down shares as 2D copies beside the same bytes in one copy; without, it reads as before.
        lim = {"h2d_bytes_per_s": 55.1e9, "hbm_bytes_per_s": 4.6e12, "disk_bytes_per_s": 1.7e9,
               "gemm_flops_per_s": 697e12}
        plain = bench.limits_line(lim)
        self.assertEqual(plain, "H2D 55.1 GB/s pinned, HBM 4.6 TB/s read, disk 1.7 GB/s O_DIRECT, "
                                "bf16 GEMM 697 TFLOP/s")
        lim["h2d_2d"] = [
            {"what": "P3 8B Q8_0 down, r 5408 of 14336", "width": 5746, "pitch": 15232, "rows": 4096,
             "bytes_per_s": 48.25e9, "contiguous_bytes_per_s": 54.9e9},
            {"what": "1 KiB rows", "width": 1024, "pitch": 3072, "rows": 32768, "bytes_per_s": 20e9,
             "contiguous_bytes_per_s": 54e9}]
        self.assertEqual(bench.limits_line(lim), plain + "; down's GPU share as a 2D copy: P3 8B Q8_0 48.2 GB/s "
                         "(5746 of 15232 bytes a row; 54.9 in one copy)")

    def test_resident_step_times(self):
        # Q1's row says the engine's decode steps and the host's time between two, where the
        # runner's stats have them; a record without them (an older replay) reads as before.
        lim = {"hbm_bytes_per_s": 4.5e12}
        rec = {"gen": {"decode_ms": 2.45}, "weights": {"bytes_per_token": 4.5e9}}
        plain = bench.ROWS["Q1"](rec, lim)[0]
        self.assertIn("| Q1 decode (8B Q4_K_M, --gpu-budget 6GiB, all resident) | 2.45 ms/token (408.2 tok/s) | "
                      "1.00 ms/token (4.50 GB/token at 4.50 TB/s HBM) | 2.45 | <= 1.5 |", plain)
        rec["step_times"] = {"steps_timed": 50, "in_steps_ms": 120.0, "gaps": 40, "between_steps_ms": 0.4}
        timed = bench.ROWS["Q1"](rec, lim)[0]
        self.assertIn("all resident; the engine's decode steps 2.400 ms each, the host between two 0.010) | 2.45 ms/token",
                      timed)

    def test_split_rows(self):
        """P1's rows from a made-up record: the limit is the unsplit bytes over H2D plus the CPU's rate,
        both as the runner measured them at once."""
        lim = {"h2d_bytes_per_s": 50e9}
        cs = {"split_ffns": 12, "r_min": 5120, "r_max": 5120, "ffn_dim": 14336, "cpu_job_us": 900.0,
              "handoff_us": 25.0, "handoff": "memops"}
        rec = {"whole": {"gen": {"decode_ms": 200.0}, "streamed_bytes_per_token": 10e9},
               "split": {"gen": {"decode_ms": 100.0}, "streamed_bytes_per_token": 6e9, "cpu_bytes_per_token": 4e9,
                         "cpu_bytes_per_s": 50e9, "cpu_share": cs}}
        rows = bench.ROWS["P1"](rec, lim)
        # A record from before the runner measured H2D beside the CPU: H2D alone in both limits.
        self.assertIn("| 100.0 ms/token | 100.0 ms/token (10.00 GB/token at 50.0 GB/s H2D beside the CPU + 50.0 GB/s "
                      "CPU beside the copies, measured at once; with H2D alone, 50.0 GB/s: 100.0 ms, 1.000) | 1.000 |",
                      rows[0])
        # The runner's H2D rate beside the CPU makes the limit; H2D alone the second one.
        rec["split"]["h2d_beside_cpu_bytes_per_s"] = 30e9
        rows = bench.ROWS["P1"](rec, lim)
        self.assertIn("| 100.0 ms/token | 125.0 ms/token (10.00 GB/token at 30.0 GB/s H2D beside the CPU + 50.0 GB/s "
                      "CPU beside the copies, measured at once; with H2D alone, 50.0 GB/s: 100.0 ms, 1.000) | 0.800 |",
                      rows[0])
        del rec["split"]["h2d_beside_cpu_bytes_per_s"]
        self.assertIn("12 FFNs split at r 5120..5120 of 14336", rows[0])
        self.assertIn("| 2.00x | - | - | >= 1.8x |", rows[1])
        # --ab: the same split with the results copied up, set against the same limit.
        rec["copy"] = {"gen": {"decode_ms": 110.0}, "cpu_share": dict(cs, handoff_us=1900.0)}
        rows = bench.ROWS["P1"](rec, lim)
        self.assertEqual(len(rows), 3)
        self.assertIn("--cpu-result copy (job 900 us, handoff 1900 us) | 110.0 ms/token | 100.0 ms/token | 1.100 |",
                      rows[2])
        # --ab: one share for the token, against its own run's rates measured at once.
        del rec["copy"]
        rec["token"] = {"gen": {"decode_ms": 90.0}, "streamed_bytes_per_token": 5e9, "cpu_bytes_per_token": 5e9,
                        "cpu_bytes_per_s": 60e9, "h2d_beside_cpu_bytes_per_s": 40e9,
                        "cpu_share": dict(cs, r_min=4096, r_max=6144)}
        rows = bench.ROWS["P1"](rec, lim)
        self.assertEqual(len(rows), 3)
        self.assertIn("--cpu-share-balance token (r 4096..6144, 5.00 GB/token on the CPU, 5.00 over PCIe; job 900 us, "
                      "handoff 25 us) | 90.0 ms/token | 100.0 ms/token (40.0 + 60.0 GB/s) | 0.900 | <= 1.10 |", rows[2])
        # ... and with the kept layer groups the first layers (--window-spread=no), a row after it; a
        # split planned anew from its jobs' rate says so.
        rec["first"] = dict(rec["token"], gen={"decode_ms": 95.0}, rates_from_jobs=True)
        rows = bench.ROWS["P1"](rec, lim)
        self.assertEqual(len(rows), 4)
        self.assertIn("the same with --window-spread=no (the kept layers the first ones) (r 4096..6144,", rows[3])
        self.assertIn("handoff 25 us; planned anew at the jobs' rate) | 95.0 ms/token | 100.0 ms/token (40.0 + 60.0 GB/s) | 0.950 |", rows[3])
        self.assertNotIn("planned anew", rows[2])
        # ... and with the memory the split frees unused (--fixed-residency); the default's row says
        # what it kept with it.
        rec["fixed"] = dict(rec["token"], gen={"decode_ms": 99.0})
        rec["split"]["refill_bytes"] = 272 * 2**20
        rows = bench.ROWS["P1"](rec, lim)
        self.assertEqual(len(rows), 5)
        self.assertIn("memops; 272 MiB more kept on the GPU with the memory the split frees) |", rows[0])
        # the split's row says where its window kept the layers spread (--window-spread auto)
        rec["split"]["spread"] = True
        self.assertIn("the split frees; the kept layers spread among the layers) |", bench.ROWS["P1"](rec, lim)[0])
        del rec["split"]["spread"]
        # the handoffs by size, the pool's start and its wait between jobs, where the runner gives them;
        # the GPU's work between split layers where auto counted it on the link's side
        rec["split"]["cpu_share"] = dict(cs, handoff_hist=[5, 3, 1, 0, 0, 1], dispatch_us=4.2, dispatch_max_us=31.0,
                                         gap_us=380.0, dispatch_stalls=3, dispatch_stall_ms=4.5)
        rec["split"]["split_gaps_ms"] = 1.9
        self.assertIn("handoff 25 us, memops (by size in us <50/50-100/100-200/200-500/500-1000/>=1000: 5/3/1/0/0/1); "
                      "the pool starts a job 4 us after its dispatch (at most 31) and waits 380 us between two; the "
                      "dispatcher off its CPU 3 times, 4.5 ms; the GPU's "
                      "work between split layers, 1.9 ms/token, counted on the link's side; 272 MiB more kept",
                      bench.ROWS["P1"](rec, lim)[0])
        rec["split"]["cpu_share"] = cs
        del rec["split"]["split_gaps_ms"]
        self.assertIn("the same with --fixed-residency (the memory the split frees unused) (r 4096..6144,", rows[4])
        self.assertIn("| 99.0 ms/token | 100.0 ms/token (40.0 + 60.0 GB/s) | 0.990 |", rows[4])
        del rec["first"], rec["fixed"], rec["split"]["refill_bytes"]
        # --repeat: the split on three instances; the rows take the median's ratio (the split's own
        # record is the first of them), and a row gives them all, by ratio; a failed one is counted.
        rec["repeats"] = [rec["split"], dict(rec["split"], gen={"decode_ms": 120.0}),
                          dict(rec["split"], gen={"decode_ms": 80.0}, cpu_share=dict(cs, cpu_job_us=700.0)),
                          {"failed": True}]
        rows = bench.ROWS["P1"](rec, lim)
        self.assertIn("| 100.0 ms/token | 100.0 ms/token (", rows[0])
        self.assertEqual(rows[2], "| P1, the split on 4 instances of its own, by ratio (1 failed) | 80.0 ms (0.800; job "
                                  "700 us), 100.0 ms (1.000; job 900 us), 120.0 ms (1.200; job 900 us) | each its own | "
                                  "median 1.000 | <= 1.10 |")
        rec["repeats"] = [rec["split"], dict(rec["split"], gen={"decode_ms": 80.0})]
        rows = bench.ROWS["P1"](rec, lim)
        self.assertIn("| 80.0 ms/token |", rows[0])  # of two, the lower
        self.assertIn("median 0.800", rows[2])
        del rec["repeats"]
        rec["split"]["failed"] = True
        self.assertEqual(bench.ROWS["P1"](rec, lim), ["| P1 | failed (see logs) | - | - | - |"])

    def test_host_profile_report(self):
        """The runner's host profile summed per function: addresses addr2line cannot name (no such
        module here) keep their exported symbol, else module+offset; most samples first."""
        prof = {"running": False, "samples": 100, "top": [
            ["/nonexistent/libcuda.so.1", "0x10", "cuLaunchKernel", 30],
            ["/nonexistent/libcuda.so.1", "0x20", "cuLaunchKernel", 25],
            ["/nonexistent/gpu-runner", "0x400", None, 20],
            ["/nonexistent/libc.so.6", "0x30", "memcpy", 5]]}
        text = bench.host_profile_report(prof)
        lines = text.splitlines()
        self.assertEqual(lines[0], "100 samples of the runner's thread's CPU time; 80 at the 4 addresses listed")
        self.assertEqual(lines[1], "     55   55.0%  cuLaunchKernel  (libcuda.so.1)")
        self.assertEqual(lines[2], "     20   20.0%  0x400  (gpu-runner)")
        self.assertEqual(lines[3], "      5    5.0%  memcpy  (libc.so.6)")

    def test_m_rows(self):
        """M1's split row against the rates its runner measured at once (each alone the second limit),
        with the default's guesses, and --ab's --predict-experts=false row against the same."""
        lim = {"h2d_bytes_per_s": 50e9, "gemm_flops_per_s": 7e14}
        w = {"bytes_per_token": 4e9, "experts": 128, "experts_used": 8, "expert_bytes": 3.2e9, "matrix_params": 2e9}
        one = {"gen": {"decode_ms": 30.0, "prompt_tokens": 512, "prefill_ms": 200.0}, "weights": w,
               "decode_h2d_bytes_per_token": 1.5e9, "experts_passed_per_token": 100.0,
               "cpu_expert_bytes_per_token": 0.0}
        split = dict(one, gen={"decode_ms": 20.0}, cpu_expert_bytes_per_token=0.7e9,
                     decode_h2d_bytes_per_token=0.8e9)
        rec = {"gpu": one, "split": split, "cpu_bytes_per_s": 100e9}
        rows = bench.ROWS["M1"](rec, lim)
        self.assertIn("| 20.0 ms/token | 10.0 ms/token (50.0 GB/s H2D + 100.0 GB/s CPU bf16 GEMV) | 2.00 | <= 1.2 |", rows[1])
        split["h2d_beside_cpu_bytes_per_s"], split["cpu_beside_bytes_per_s"] = 45e9, 55e9
        rows = bench.ROWS["M1"](rec, lim)
        self.assertIn("| 20.0 ms/token | 15.0 ms/token (45.0 GB/s H2D beside the CPU + 55.0 GB/s CPU beside the copies, "
                      "measured at once; each alone, 50.0 + 100.0 GB/s bf16 GEMV: 10.0 ms, 2.00) | 1.33 | <= 1.2 |", rows[1])
        # With --profile-copies the same bytes at the rates the decode ran at: the copies' and the spans'.
        split.update(decode_copy_ms_per_token=16.0, cpu_experts_span_bytes_per_token=0.7e9,
                     cpu_experts_span_ms_per_token=10.0)
        rows = bench.ROWS["M1"](rec, lim)
        self.assertIn("(the link busy 16.0 ms a token with them, 50.0 GB/s: --profile-copies)", rows[1])
        self.assertIn("10.0 ms, 2.00; at the rates the decode ran at, 50.0 GB/s over the timed copies + 70.0 over the "
                      "CPU's spans: 12.5 ms, 1.60) | 1.33 | <= 1.2 |", rows[1])
        # The layers' ends as the routings measured them (--balance-ends).
        split.update(ends_gpu_late_ms_per_token=0.4, ends_cpu_late_ms_per_token=0.25, ends_measured_per_token=22.0,
                     ends_lag_ms_before=0.012, ends_lag_ms=0.047)
        rows = bench.ROWS["M1"](rec, lim)
        self.assertIn("the layers' ends as measured: the GPU's side last by 0.40 ms a token, the CPU's by 0.25 "
                      "(22.0 layers a token), the routes' lag for it 12 -> 47 us", rows[1])
        for k in ("ends_gpu_late_ms_per_token", "ends_cpu_late_ms_per_token", "ends_measured_per_token",
                  "ends_lag_ms_before", "ends_lag_ms"):
            del split[k]
        del split["decode_copy_ms_per_token"], split["cpu_experts_span_bytes_per_token"], \
            split["cpu_experts_span_ms_per_token"]
        split.update(guessed_per_token=40.0, guess_hits_per_token=30.0, window_host_ms_per_token=2.5)
        rows = bench.ROWS["M1"](rec, lim)
        self.assertIn("its window's calls took 2.5; 40.0 experts a token copied on a guess, 30.0 of them chosen) "
                      "against", rows[1])
        split.update(cpu_step_gap_ms_per_token=1.04, host_between_steps_ms=0.123)
        rows = bench.ROWS["M1"](rec, lim)
        self.assertIn("from a token's last to the next token's first 1.0 ms (the host's between two steps 0.12), ",
                      rows[1])
        rec["nopredict"] = dict(split, gen={"decode_ms": 21.0})
        rows = bench.ROWS["M1"](rec, lim)
        self.assertEqual(len(rows), 3)
        self.assertIn("the same with --predict-experts=false (0.70 GB/token on the CPU, 0.80 copied) | "
                      "21.0 ms/token | 15.0 ms/token | 1.40 | <= 1.2 |", rows[2])

    def test_m_experts_alone(self):
        """bench-cpu-gemv --experts' line read, and its row beside M1's where the record has it."""
        line = ("experts Q4_K avx512-vnni: 4 of 2.7 MB a layer (32 to choose from), jobs cut for 1 threads (8 parts, "
                "chunks of about 216 KB, too few to taper), 14 workers, a gap of 150 us: a layer's span median 0.134 ms "
                "(79.24 GB/s), mean 0.140 ms (75.77 GB/s), best 0.104 ms; parts waiting for their job's first phase "
                "8.5% of the workers' time\n")
        self.assertEqual(bench.parse_experts_alone(line), {"ms": 0.134, "gbs": 79.24, "wait_pct": 8.5})
        self.assertIsNone(bench.parse_experts_alone("experts: making 32 experts\n"))
        lim = {"h2d_bytes_per_s": 50e9, "gemm_flops_per_s": 7e14}
        w = {"bytes_per_token": 4e9, "experts": 128, "experts_used": 8, "expert_bytes": 3.2e9, "matrix_params": 2e9}
        one = {"gen": {"decode_ms": 30.0}, "weights": w, "decode_h2d_bytes_per_token": 1.5e9,
               "experts_passed_per_token": 100.0, "cpu_expert_bytes_per_token": 0.0}
        rec = {"gpu": one, "split": dict(one, cpu_expert_bytes_per_token=0.7e9), "cpu_bytes_per_s": 100e9}
        self.assertEqual(len(bench.ROWS["M2"](rec, lim)), 2)
        rec["experts_alone"] = {"default": {"ms": 0.134, "gbs": 79.2, "wait_pct": 8.5},
                                "spin": {"ms": 0.15, "gbs": 70.0, "wait_pct": 9.0}, "k": 4, "threads": 14}
        rows = bench.ROWS["M2"](rec, lim)
        self.assertEqual(len(rows), 3)
        self.assertIn("| M2, the CPU's experts alone (bench-cpu-gemv --experts 4: 768 x 2048 Q4_K, 14 workers; a layer's "
                      "span median, and the parts' time waiting between phases; waiting parts spinning 0.150 ms (70.0 "
                      "GB/s, 9.0%)) | 0.134 ms (79.2 GB/s, 8.5%) | - | - | - |", rows[2])
        # The pool it drew from, where the record has it: 2 GiB of experts, past the CPU's caches.
        rec["experts_alone"]["pool"] = bench.experts_alone_pool("Q4_K")
        self.assertIn("768 x 2048 Q4_K, 810 to choose from, 14 workers", bench.ROWS["M2"](rec, lim)[2])
        self.assertEqual((bench.experts_alone_pool("BF16"), bench.experts_alone_pool("F16")), (228, 32))

    def test_mres_rows(self):
        """M1R's row against the active parameters' bytes at the HBM rate, with the --moe-host-route and
        --experts-apart runs beside it where the record has them."""
        lim = {"hbm_bytes_per_s": 4e12}
        w = {"bytes_per_token": 4e9, "experts": 128, "experts_used": 8, "expert_bytes": 3.2e9, "matrix_params": 2e9}
        rec = {"gen": {"decode_ms": 4.0}, "weights": w}
        rows = bench.ROWS["M1R"](rec, lim)
        self.assertEqual(len(rows), 1)
        self.assertNotIn("--experts-apart", rows[0])
        rec["apart"] = {"gen": {"decode_ms": 5.5}, "weights": w}
        rows = bench.ROWS["M1R"](rec, lim)
        self.assertIn("all resident; each expert launched on its own (--experts-apart): 5.50 ms/token) | 4.00 ms/token", rows[0])
        rec["host"] = {"gen": {"decode_ms": 4.75}, "weights": w}
        self.assertIn("all resident; routed on the host (--moe-host-route): 4.75 ms/token; each expert launched on "
                      "its own (--experts-apart): 5.50 ms/token) | 4.00 ms/token", bench.ROWS["M1R"](rec, lim)[0])
        rec["apart"] = {"failed": True}
        self.assertIn("; each expert launched on its own failed (see logs)", bench.ROWS["M1R"](rec, lim)[0])

    def test_d1_rows(self):
        """D1's rows: the two-link limit is the larger rank's copy time, the one-after-the-other one the sum."""
        ranks = [{"streamed_bytes_per_token": 5e9, "h2d_bytes_per_s": 50e9, "window_bytes": 2**30, "layer0": 0,
                  "layer1": 15},
                 {"streamed_bytes_per_token": 4e9, "h2d_bytes_per_s": 40e9, "window_bytes": 2**30, "layer0": 15,
                  "layer1": 32}]
        rec = {"gen": {"decode_ms": 150.0}, "ranks": ranks, "link": "nccl", "s1_ms_per_token": 172.5,
               "tokens_equal_s1": "128 of 128 equal"}
        rows = bench.ROWS["D1"](rec, {})
        self.assertIn("rank 1 layers 15..31: 4.00 GB/token at 40.0 GB/s", rows[0])
        self.assertIn("| 150.0 ms/token | 100.0 ms/token (two-link: both links at once) | 1.500 |", rows[0])
        self.assertIn("| 150.0 ms/token | 200.0 ms/token (the sum of the ranks' copy times) | 0.750 |", rows[1])
        # (5 - 1.07) / 50 + (4 - 1.07) / 40 GB: 78.5 + 73.2 ms
        self.assertIn("| 150.0 ms/token | 151.7 ms/token | 0.989 |", rows[2])
        self.assertIn("| 1.15x |", rows[3])
        self.assertIn("| 128 of 128 equal |", rows[4])
        self.assertEqual(bench.ROWS["D1"]({"failed": True}, {}), ["| D1 | failed (see logs) | - | - | - |"])

    def test_b_rows(self):
        """B1: each level's aggregate rate against the single request's; B2: against the HBM bound x requests."""
        lv = lambda c, tps: {"concurrency": c, "tokens_per_s": tps, "ttft_p50_s": 0.25, "ttft_max_s": 0.5,
                             "streams": c, "ok": c}
        rec = {"levels": [lv(1, 10.0), lv(16, 130.0)]}
        rows = bench.ROWS["B1"](rec, {})
        self.assertIn("| B1 8B bf16 over HTTP, --gpu-budget 6GiB (streamed), 1 at once | 10.0 tok/s, TTFT p50 250 ms", rows[0])
        self.assertIn("| 13.0x the single request's 10.0 tok/s | - | >= 12x the single rate |", rows[1])
        rec["bound_tok_s"] = 200.0
        rows = bench.ROWS["B2"](rec, {})
        self.assertIn("| 3200.0 tok/s (16 x the HBM-bound rate 200.0) | 24.62 |", rows[1])
        rec["levels"][1]["ok"] = 14
        self.assertIn("; 2 failed", bench.ROWS["B2"](rec, {})[1])
        self.assertEqual(bench.ROWS["B1"]({"failed": True}, {}), ["| B1 | failed (see the logs) | - | - | - |"])

    def test_failed_rows(self):
        lim = {}
        self.assertEqual(bench.rows_s1({"failed": True}, lim), ["| S1 | failed (see logs) | - | - | - |"])
        self.assertEqual(bench.rows_k2({"failed": True}, lim), ["| K2 | failed (see logs) | - | - | - |"])
        self.assertEqual(bench.rows_check({"failed": True}, lim), [
            "| compute-sanitizer memcheck | failed (see logs) | - | - | 0 errors |",
            "| compute-sanitizer racecheck | failed (see logs) | - | - | 0 errors |",
            "| --strict S1 | failed (see logs) | - | - | none |"])
        self.assertEqual(bench.rows_s3({"gen": {}, "disk_bytes_per_token": 1, "strict_violations": 3, "failed": True}, lim),
                         ["| S3 | failed (see logs) | - | - | - |"])
        self.assertEqual(bench.strict_row("--strict S3", 3), "| --strict S3 | 3 violation lines | - | - | none |")


class CommandLine(unittest.TestCase):
    def run_bench(self, *args):
        return subprocess.run([sys.executable, "-B", SCRIPT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)

    def test_help(self):
        p = self.run_bench("--help")
        self.assertEqual(p.returncode, 0)
        for word in ("--scenarios", "--work", "--quick", "--replay", "S1, S2, S3, Q1, Q2, Q3, P1, P2,"):
            self.assertIn(word, p.stdout)

    def test_replay_some(self):
        p = self.run_bench("--replay", SAMPLE, "--scenarios", "S2,K1")
        self.assertEqual(p.returncode, 0, p.stderr)
        rows = [line for line in p.stdout.splitlines() if line.startswith("| S") or line.startswith("| K")]
        self.assertEqual([r.split(" ")[1] for r in rows], ["S2", "K1"])

    def test_rounds_need_alternate(self):
        self.assertEqual(self.run_bench("--rounds", "2", "--replay", SAMPLE).returncode, 2)
        self.assertEqual(self.run_bench("--rounds", "0", "--alternate=--x", "--replay", SAMPLE).returncode, 2)

    def test_expert_cpu_rate(self):
        self.assertEqual(bench.expert_cpu_rate({"Q4_K": 127e9, "Q6_K": 195e9}, "Q4_K"), 127e9)
        self.assertEqual(bench.expert_cpu_rate({"BF16": 104e9}, "BF16"), 104e9)
        self.assertEqual(bench.expert_cpu_rate({"Q4_K": 127e9, "Q6_K": 195e9}, ""), 195e9)
        self.assertEqual(bench.expert_cpu_rate({}, "Q4_K"), 0)

    def test_alternation_summary(self):
        tagged = [("A", "| M2R decode (all resident) | 2.29 ms/token | 0.12 | 19.1 | - |"),
                  ("B", "| M2R decode (all resident) | 2.13 ms/token | 0.12 | 17.8 | - |"),
                  ("A", "| M2R decode (all resident) | 2.30 ms/token | 0.12 | 19.2 | - |"),
                  ("B", "| M2 | failed (see logs) | - | - | - |")]
        got = bench.alternation_summary(tagged, "--runner-opt=--moe-host-route").splitlines()
        self.assertIn("B: --runner-opt=--moe-host-route", got[0])
        self.assertEqual(got[4:], ["| M2R decode (all resident) | 2.29 ms/token (limit 0.12); 2.30 ms/token (limit 0.12) "
                                   "| 2.13 ms/token (limit 0.12) |",
                                   "| M2 |  | failed (see logs) |"])
        # Figures inside the parentheses differ run to run: still one row; a fixed setting before
        # them names a row of its own.
        tagged = [("A", "| M2 decode (0.20 GB/token on the CPU, spans 2.7 ms) | 5.2 ms/token | - | 5.02 | - |"),
                  ("B", "| M2 decode (0.16 GB/token on the CPU, spans 1.6 ms) | 4.3 ms/token | 3.1 ms/token (40 GB/s + 90 GB/s) | 1.39 | - |"),
                  ("A", "| M2 decode at 0.25 (0.1 GB) | 6.0 ms/token | 1.0 | 6.0 | - |"),
                  ("B", "| M2 decode at 0.5 (0.1 GB) | 7.0 ms/token | 1.0 | 7.0 | - |")]
        got = bench.alternation_summary(tagged, "--x").splitlines()
        self.assertEqual(got[4:], ["| M2 decode (0.20 GB/token on the CPU, spans 2.7 ms) | 5.2 ms/token | 4.3 ms/token "
                                   "(limit 3.1 ms/token) |",
                                   "| M2 decode at 0.25 (0.1 GB) | 6.0 ms/token (limit 1.0) |  |",
                                   "| M2 decode at 0.5 (0.1 GB) |  | 7.0 ms/token (limit 1.0) |"])
        # After the way (before its first ':' or ';'), one run's clauses that another's lacks: one row.
        tagged = [("A", "| MX2 decode (--cpu-share auto: 0.92 GB/token, the routes weighing them at 77.7 GB/s, "
                        "the gaps 2.0 ms) | 14.1 ms/token | 11.7 ms/token (50.0 + 78.6) | 1.21 | <= 1.2 |"),
                  ("B", "| MX2 decode (--cpu-share auto: 0.92 GB/token, the gaps 1.0 ms) | 14.1 ms/token | "
                        "11.3 ms/token (49.1 + 84.4) | 1.25 | <= 1.2 |"),
                  ("B", "| MX2 decode (--cpu-share 0; 1.50 GB/token copied) | 29.4 ms/token | 27.1 ms/token | 1.08 | - |")]
        got = bench.alternation_summary(tagged, "--x").splitlines()
        self.assertEqual(got[4:], ["| MX2 decode (--cpu-share auto: 0.92 GB/token, the routes weighing them at 77.7 GB/s, "
                                   "the gaps 2.0 ms) | 14.1 ms/token (limit 11.7 ms/token) | 14.1 ms/token (limit 11.3 ms/token) |",
                                   "| MX2 decode (--cpu-share 0; 1.50 GB/token copied) |  | 29.4 ms/token (limit 27.1 ms/token) |"])

    def test_unknown(self):
        self.assertEqual(self.run_bench("--scenarios", "S1,S9").returncode, 2)
        self.assertEqual(self.run_bench("--frobnicate").returncode, 2)
        self.assertEqual(self.run_bench("--replay", os.path.join(SAMPLE, "nothing-here")).returncode, 1)


FAKE_PIPECTL = r"""
import json, os, sys
run = os.environ["PIPELINE_RUN_DIR"]
state = os.path.join(run, "fetched")
with open(os.path.join(run, "calls"), "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\n")
if sys.argv[1] == "generate":
    a = sys.argv
    tokens, n = a[a.index("--tokens") + 1], int(a[a.index("-n") + 1])
    ids = open(tokens[1:]).read() if tokens.startswith("@") else tokens
    if "long" in tokens and os.path.exists(state):  # a long context fetches KV blocks
        fetched = int(open(state).read()) + (7 if n == 1 else 7 + 100 * (n - 1))
        open(state, "w").write(str(fetched))
    print(" ".join(str(i) for i in range(n)))
    if "--stats" in a and "--json" in a:
        print(json.dumps({"prompt_tokens": len(ids.split(",")), "prefill_ms": 20.0 + n, "tokens_generated": n,
                          "reason": "length", "decode_ms": 4.0 * (n - 1)}), file=sys.stderr)
    elif "--stats" in a:
        print("prompt ...: prefill ... (text on stderr)", file=sys.stderr)
elif sys.argv[1:] == ["stats", "gpu-runner"]:
    if not os.path.exists(state):
        open(state, "w").write("0")
    print(json.dumps({"kv_blocks_fetched": int(open(state).read()), "kv_block_bytes": 1048576,
                      "kv_prefix_positions": 8192, "kv_prefix_blocks_on_gpu": 1024,
                      "gpu_window": {"streamed_bytes_per_token": 2000000000, "copy_ms": 50.0}}, indent=2))
elif sys.argv[1:] == ["stats", "ssd-loader"]:
    print(json.dumps({"disk_bytes_per_token": 3000000000}))
elif sys.argv[1:] == ["stats", "kv-store"]:
    print("{}")
else:
    sys.exit(2)
"""

FAKE_PIPELINE = r"""
import os, sys
run = os.environ["PIPELINE_RUN_DIR"]
if sys.argv[1] == "start":
    if os.environ.get("FAKE_START_FAILS") == os.environ["PIPELINE_INSTANCE"]:
        print("start failed on purpose")
        sys.exit(1)
    os.makedirs(run, exist_ok=True)
    for name in ("calls", "fetched"):
        if os.path.exists(os.path.join(run, name)):
            os.remove(os.path.join(run, name))
    with open(os.path.join(run, "gpu-runner.log"), "w") as f:
        f.write("runner up\n")
        if "--runner-opt=--strict" in sys.argv and "S3" in os.environ["PIPELINE_INSTANCE"]:
            f.write("[err] --strict: group late\n")
        if os.environ.get("PIPELINE_WRAP_GPU_RUNNER"):
            f.write("========= ERROR SUMMARY: 0 errors\n")
    with open(os.path.join(run, "start-args"), "w") as f:
        f.write(" ".join(sys.argv[1:]) + " " + os.environ.get("PIPELINE_READY_TIMEOUT", "") + "\n")
"""


class RunWithFakes(unittest.TestCase):
    """The scenarios' steps, with stand-ins for scripts/pipeline and pipectl (a GPU run's
    commands, in order, and what they print)."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        t = self.tmp.name
        self.b = bench.Bench(t, os.path.join(t, "work"), quick=True)
        for name, text in (("pipectl", FAKE_PIPECTL), ("pipeline", FAKE_PIPELINE)):
            path = os.path.join(t, name)
            with open(path, "w") as f:
                f.write(f"#!{sys.executable}\n{text}")
            os.chmod(path, 0o755)
        self.b.pipectl, self.b.pipeline, self.b.bin = os.path.join(t, "pipectl"), os.path.join(t, "pipeline"), t
        self.m8 = os.path.join(self.b.work, "llama3-8b")
        for d in (self.m8, os.path.join(self.b.work, "llama3-8b-4l")):
            os.makedirs(d)
            write_safetensors(os.path.join(d, "model.safetensors"),
                              llama_tensors(vocab=2000, dim=64, layers=2, ffn=128, kv_dim=32, tied=False))
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump({"vocab_size": 2000}, f)
            open(os.path.join(d, ".complete"), "w").close()
        self.lim = {"h2d_bytes_per_s": 50e9, "hbm_bytes_per_s": 3e12, "disk_bytes_per_s": 2e9, "gemm_flops_per_s": 600e12}

    def tearDown(self):
        self.tmp.cleanup()

    def calls(self, name):
        with open(os.path.join(self.b.work, f"run-{name}", "calls")) as f:
            return f.read().splitlines()

    def test_s1_s2_s3(self):
        rec = self.b.run_s1(self.m8)
        self.assertEqual(rec["gen"]["generated_tokens"], 16)
        self.assertEqual((rec["streamed_bytes_per_token"], rec["copy_ms"]), (2000000000, 50.0))
        self.assertEqual(rec["weights"]["vocab_size"], 2000)
        calls = self.calls("S1")
        self.assertTrue(calls[0].startswith("generate --tokens 513,") and
                        calls[0].endswith(f" -n {bench.WARMUP_TOKENS} --ignore-eos"))
        self.assertEqual(calls[1:], ["stats ssd-loader", calls[2], "stats gpu-runner", "stats ssd-loader"])
        self.assertTrue(calls[2].endswith(" -n 16 --ignore-eos --stats --json"))
        with open(os.path.join(self.b.work, "run-S1", "start-args")) as f:
            self.assertIn("--gpu-budget 6GiB --dram-budget 64GiB --runner-opt=--prefill-chunk=512", f.read())
        for name in ("S1.gen", "S1.tokens", "S1.runner.json", "S1.loader0.json", "S1.loader.json", "S1.gpu-runner.log"):
            self.assertTrue(os.path.exists(self.b.res(name)), name)
        self.assertIn("| S1 decode (8B, --gpu-budget 6GiB) | 4.0 ms/token | 40.0 ms/token", bench.rows_s1(rec, self.lim)[0])
        rec = self.b.run_s2(self.m8)
        self.assertIn("| S2 decode (8B, all resident) | 4.00 ms/token |", bench.rows_s2(rec, self.lim)[0])
        rec = self.b.run_s3(self.m8)
        self.assertEqual((rec["disk_bytes_per_token"], rec["strict_violations"]), (3000000000, 1))
        self.assertEqual(bench.rows_s3(rec, self.lim)[0], "| --strict S3 | 1 violation lines | - | - | none |")

    def test_p_repeat(self):
        """--repeat 3: P1's split on three instances of its own, after the unsplit one."""
        self.b.repeat = 3
        rec = self.b.run_p("P1", self.m8, "6GiB", "64GiB")
        self.assertEqual(len(rec["repeats"]), 3)
        self.assertIs(rec["repeats"][0], rec["split"])
        for name in ("P1-whole", "P1", "P1-r2", "P1-r3"):
            with open(os.path.join(self.b.work, f"run-{name}", "start-args")) as f:
                self.assertIn("--cpu-share " + ("0" if name == "P1-whole" else "auto"), f.read())
        self.assertFalse(os.path.exists(os.path.join(self.b.work, "run-P1-r4")))

    def test_check(self):
        rec = self.b.run_check(self.m8)
        self.assertEqual(rec, {"sanitizers": {"memcheck": "ERROR SUMMARY: 0 errors", "racecheck":
                                              "ERROR SUMMARY: 0 errors; hazards in the project's kernels: 0 (cuBLAS nvjet: 0)"},
                               "strict_violations": 0})

    def test_k1(self):
        rec = self.b.run_k1(self.m8)
        self.assertEqual(rec["new_tokens"], 8)
        # Counted from the first stats call on; one token fetches 7, nine fetch 7 + 800.
        self.assertEqual(rec["fetched"], [0, 7, 814])
        self.assertEqual(rec["short"]["prompt_tokens"], 512)
        self.assertEqual(rec["long"]["prompt_tokens"], 32768 - 8 - 1)
        row = bench.rows_k1(rec, self.lim)[0]
        self.assertIn("4.0 ms weights + 0.10 GB KV/token", row)  # 800 blocks / 8 tokens x 1 MiB
        for name in ("K1.runner.json", "K1.kv.json", "K1.gpu-runner.log"):
            self.assertTrue(os.path.exists(self.b.res(name)), name)

    def test_k2(self):
        rec = self.b.run_k2(self.m8)
        self.assertEqual((rec["cold"]["prompt_tokens"], rec["warm"]["prompt_tokens"]), (8256, 8256))
        self.assertGreater(rec["wall_cold_ms"], 0)
        self.assertIn("8192 positions restored, 1024 blocks still on the GPU", bench.rows_k2(rec, self.lim)[0])

    def test_alternate_rounds(self):
        """--alternate with two rounds: A, B, then B, A (every second round in reverse), B's instances
        started with the options added, each run's record in a folder of its own with the limits, the
        rows tagged."""
        with open(self.b.res("limits.json"), "w") as f:
            json.dump(self.lim, f)
        seen = []

        def s2():
            seen.append(os.environ.get("BENCH_START_OPTS", ""))
            return {"failed": True}
        os.environ["BENCH_START_OPTS"] = "--runner-opt=--strict"
        try:
            rows, tagged = bench.run_rounds(self.b, {"S2": s2}, {}, {"S2"}, self.lim, "--runner-opt=--moe-host-route", 2)
            self.assertEqual(os.environ["BENCH_START_OPTS"], "--runner-opt=--strict")
        finally:
            del os.environ["BENCH_START_OPTS"]
        both = "--runner-opt=--strict --runner-opt=--moe-host-route"
        self.assertEqual(seen, ["--runner-opt=--strict", both, both, "--runner-opt=--strict"])
        self.assertEqual([r.split("]")[0] for r in rows], ["| [round 1, A", "| [round 1, B", "| [round 2, B",
                                                         "| [round 2, A"])
        self.assertEqual([t for t, _ in tagged], ["A", "B", "B", "A"])
        for d in ("round1A", "round1B", "round2A", "round2B"):
            for name in ("limits.json", "S2.record.json", "S2.rows"):
                self.assertTrue(os.path.exists(os.path.join(self.b.results, d, name)), f"{d}/{name}")
        summary = bench.alternation_summary(tagged, "--runner-opt=--moe-host-route")
        self.assertIn("| S2 | failed (see logs); failed (see logs) | failed (see logs); failed (see logs) |", summary)
        # Two alternates: A, B, C each round, C with the second's options; the summary a column each.
        seen.clear()
        rows, tagged = bench.run_rounds(self.b, {"S2": s2}, {}, {"S2"}, self.lim,
                                        ["--runner-opt=--prefetch-depth=8", "--runner-opt=--prefetch-depth=20"], 2)
        self.assertEqual(seen, ["", "--runner-opt=--prefetch-depth=8", "--runner-opt=--prefetch-depth=20",
                                "--runner-opt=--prefetch-depth=20", "--runner-opt=--prefetch-depth=8", ""])
        self.assertEqual([r.split("]")[0] for r in rows][:3], ["| [round 1, A", "| [round 1, B", "| [round 1, C"])
        self.assertTrue(os.path.exists(os.path.join(self.b.results, "round2C", "S2.record.json")))
        summary = bench.alternation_summary(tagged, ["--runner-opt=--prefetch-depth=8",
                                                     "--runner-opt=--prefetch-depth=20"]).splitlines()
        self.assertEqual(summary[0], "A against B against C (B: --runner-opt=--prefetch-depth=8, C: "
                         "--runner-opt=--prefetch-depth=20), each row's measured figure (and the limit its run measured) in the order the runs went:")
        self.assertEqual(summary[2:], ["| row | A | B | C |", "| --- | --- | --- | --- |",
                                       "| S2 | " + " | ".join(["failed (see logs); failed (see logs)"] * 3) + " |"])
        # Without --alternate: one run, as before, into the results folder itself.
        rows, tagged = bench.run_rounds(self.b, {"S2": s2}, {}, {"S2"}, self.lim)
        self.assertEqual(rows, ["| S2 | failed (see logs) | - | - | - |"])
        self.assertEqual(seen[-1], "")

    def test_start_fails(self):
        os.environ["FAKE_START_FAILS"] = "bench-S1"
        try:
            self.assertEqual(self.b.run_s1(self.m8), {"failed": True})
        finally:
            del os.environ["FAKE_START_FAILS"]
        with open(self.b.res("S1.start")) as f:
            self.assertIn("start failed on purpose", f.read())


if __name__ == "__main__":
    unittest.main()
