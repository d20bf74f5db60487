#!/usr/bin/env python3
"""test_profile_decode - scripts/profile-decode's reading of ncu's CSV, without a GPU: a recorded
decode step (ncu/decode-q4km.csv: bench-kernels --quant --profile decode on an H200, its first two
layers, the final norm, lm_head and the pick), its grouping and table, and its refusals.

    python3 -B tests/bench/test_profile_decode.py        (ctest: profile_decode_script, label unit)
"""
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.environ.get("PIPELINE_SOURCE_DIR", os.path.dirname(os.path.dirname(HERE)))
SCRIPT = os.path.join(SOURCE, "scripts", "profile-decode")
SAMPLE = os.path.join(HERE, "ncu", "decode-q4km.csv")

sys.dont_write_bytecode = True
_loader = importlib.machinery.SourceFileLoader("profile_decode", SCRIPT)
_spec = importlib.util.spec_from_loader("profile_decode", _loader)
pd = importlib.util.module_from_spec(_spec)
_loader.exec_module(pd)

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
          '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def row(kid, name, metric, unit, value):
    return (f'"{kid}","1","bench-kernels","h","{name}","1","7","(256, 1, 1)","(4, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


def kernel(kid, name, us_ns, nbytes, grid=4, regs=32):
    return [row(kid, name, "dram__bytes_read.sum", "byte", f"{nbytes:,}"),
            row(kid, name, "gpu__time_duration.sum", "ns", f"{us_ns:,}"),
            row(kid, name, "launch__grid_size", "", str(grid)),
            row(kid, name, "launch__registers_per_thread", "register/thread", str(regs))]


class Parse(unittest.TestCase):
    def setUp(self):
        with open(SAMPLE, encoding="utf-8") as f:
            self.kernels = pd.parse(f.read())

    def test_recorded_step(self):
        k = self.kernels
        self.assertEqual(len(k), 17)
        self.assertEqual(k[0]["name"], "dequant_kernel<5, float, 1>")
        self.assertEqual(k[1]["name"], "dq_sm_kernel<5, 0>")
        self.assertEqual(k[1]["grid"], "528")
        self.assertEqual(k[1]["regs"], 64)
        # the step's last kernel: the pick of the token
        self.assertEqual(k[-1]["name"], "argmax_kernel")
        # lm_head: 431 MB of Q6_K in 130 us
        lm = k[-2]
        self.assertEqual(lm["name"], "dq_sm_kernel<7, 0>")
        self.assertAlmostEqual(lm["bytes"] / 1e6, 431.1, delta=0.1)
        self.assertAlmostEqual(lm["us"], 130.2, delta=0.1)

    def test_groups(self):
        rows = pd.group(self.kernels)
        self.assertEqual(rows[0]["name"], "dq_sm_kernel<7, 0>")  # lm_head, the longest
        self.assertEqual(rows[0]["calls"], 1)
        by = {(r["name"], r["grid"]): r for r in rows}
        self.assertEqual(by[("attn_kernel<__nv_bfloat16>", "136")]["calls"], 2)
        # the same kernel with other bytes is another row (the v product against lm_head)
        self.assertEqual(by[("dq_sm_kernel<7, 0>", "128")]["calls"], 2)
        self.assertEqual(sum(r["calls"] for r in rows), 17)
        self.assertAlmostEqual(sum(r["us"] for r in rows), sum(k["us"] for k in self.kernels))

    def test_table(self):
        t = pd.table(self.kernels)
        self.assertIn("| dq_sm_kernel<5, 2> | 396 | 77 | 2 |", t)
        self.assertIn("17 kernels, 0.314 ms one after another, 0.666 GB read", t)

    def test_units(self):
        text = "\n".join(["==PROF== Connected", HEADER] + kernel(0, "void a_kernel(int)", 2500, 1000) +
                         [row(1, "b_kernel", "gpu__time_duration.sum", "us", "1.5"),
                          row(1, "b_kernel", "dram__bytes_read.sum", "Mbyte", "2"),
                          row(1, "b_kernel", "launch__grid_size", "", "8"),
                          row(1, "b_kernel", "launch__registers_per_thread", "register/thread", "40")])
        k = pd.parse(text)
        self.assertEqual([x["name"] for x in k], ["a_kernel", "b_kernel"])
        self.assertAlmostEqual(k[0]["us"], 2.5)
        self.assertEqual(k[0]["bytes"], 1000)
        self.assertAlmostEqual(k[1]["us"], 1.5)
        self.assertEqual(k[1]["bytes"], 2e6)


class Refusals(unittest.TestCase):
    def refused(self, text, words):
        with self.assertRaises(pd.ProfileError) as cm:
            pd.parse(text)
        self.assertIn(words, str(cm.exception))

    def test_no_header(self):
        self.refused("==PROF== Disconnected\n", "no ncu CSV header")

    def test_no_kernel(self):
        self.refused(HEADER + "\n", "holds no kernel")

    def test_unknown_unit(self):
        lines = kernel(0, "k", 10, 10)
        lines[1] = row(0, "k", "gpu__time_duration.sum", "fortnight", "3")
        self.refused("\n".join([HEADER] + lines), "unknown unit 'fortnight'")

    def test_not_a_number(self):
        lines = kernel(0, "k", 10, 10)
        lines[0] = row(0, "k", "dram__bytes_read.sum", "byte", "n/a")
        self.refused("\n".join([HEADER] + lines), "not a number: 'n/a'")

    def test_missing_metric(self):
        lines = kernel(0, "k", 10, 10)[1:]  # no bytes
        self.refused("\n".join([HEADER] + lines), "no time or no bytes")


class CommandLine(unittest.TestCase):
    def run_script(self, *args):
        return subprocess.run([sys.executable, "-B", SCRIPT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)

    def test_replay(self):
        p = self.run_script("--replay", SAMPLE)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertTrue(p.stdout.startswith("| kernel | grid |"))
        self.assertIn("17 kernels", p.stdout)

    def test_replay_missing(self):
        with tempfile.TemporaryDirectory() as d:
            p = self.run_script("--replay", os.path.join(d, "none.csv"))
        self.assertEqual(p.returncode, 1)
        self.assertIn("profile-decode: cannot read", p.stderr)

    def test_no_bench_kernels(self):
        with tempfile.TemporaryDirectory() as d:
            p = self.run_script("--bench", os.path.join(d, "bench-kernels"))
        self.assertEqual(p.returncode, 1)
        self.assertIn("no bench-kernels at", p.stderr)

    def test_help(self):
        p = self.run_script("--help")
        self.assertEqual(p.returncode, 0)
        self.assertIn("--replay", p.stdout)


if __name__ == "__main__":
    unittest.main()
