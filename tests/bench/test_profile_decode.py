#!/usr/bin/env python3
"""test_profile_decode - scripts/profile-decode's reading of ncu's CSV, without a GPU: a recorded
decode step (ncu/decode-q4km.csv: bench-kernels --quant --profile decode on an H200, its first two
layers, the final norm, lm_head and the pick), its grouping and table, and its refusals; and the
command --run-local gives ncu (a checkpoint's prompt chunk in run-local on CUDA), not run.

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
        self.assertIn("--run-local", p.stdout)


def tool(d, name):
    """An executable stand-in at d/name (never run: command() only checks it is there)."""
    path = os.path.join(d, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write("#!/bin/sh\nexit 0\n")
    os.chmod(path, 0o755)
    return path


class RunLocal(unittest.TestCase):
    """--run-local: the command ncu runs (run-local on CUDA, the prompt in one chunk, the step named
    to the backend) and the refusals, without running it."""

    def args(self, *argv):
        return pd.parser().parse_args(["--ncu", self.ncu, "--bench", self.rl, *argv])

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.ncu = tool(self.dir.name, "ncu")
        self.rl = tool(self.dir.name, "run-local")
        self.model = os.path.join(self.dir.name, "m.gguf")
        open(self.model, "w").close()

    def tearDown(self):
        self.dir.cleanup()

    def test_command(self):
        cmd, env = pd.command(self.args("--run-local", self.model, "--prompt", "6"))
        self.assertEqual(cmd[0], self.ncu)
        self.assertIn("--profile-from-start", cmd)
        i = cmd.index(self.rl)
        self.assertEqual(cmd[i:], [self.rl, "--backend", "cuda", "--model", self.model, "--tokens", "1,2,3,4,5,6",
                                   "--max-new", "1", "--prefill-chunk", "6"])
        self.assertEqual(env["PIPELINE_CUDA_PROFILE_STEP"], "1")

    def test_decode_step(self):
        cmd, env = pd.command(self.args("--run-local", self.model, "--prompt", "4", "--decode-step", "3"))
        i = cmd.index(self.rl)
        self.assertEqual(cmd[i:], [self.rl, "--backend", "cuda", "--model", self.model, "--tokens", "1,2,3,4",
                                   "--max-new", "4", "--prefill-chunk", "4"])
        self.assertEqual(env["PIPELINE_CUDA_PROFILE_DECODE"], "3")
        self.assertEqual(env.get("PIPELINE_CUDA_PROFILE_STEP"), os.environ.get("PIPELINE_CUDA_PROFILE_STEP"))

    def test_decode_unchanged(self):
        cmd, env = pd.command(self.args("--quant"))
        self.assertEqual(cmd[-4:], [self.rl, "--profile", "decode", "--quant"])
        self.assertEqual(env.get("PIPELINE_CUDA_PROFILE_STEP"), os.environ.get("PIPELINE_CUDA_PROFILE_STEP"))

    def refused(self, words, *argv):
        with self.assertRaises(pd.ProfileError) as cm:
            pd.command(self.args(*argv))
        self.assertIn(words, str(cm.exception))

    def test_refusals(self):
        self.refused("a prefill step takes 2..", "--run-local", self.model, "--prompt", "1")
        self.refused("no checkpoint at", "--run-local", os.path.join(self.dir.name, "none"))
        self.refused("--quant is bench-kernels' weights", "--run-local", self.model, "--quant")
        self.refused("--decode-step 0: 1..", "--run-local", self.model, "--decode-step", "0")
        self.refused("--decode-step takes --run-local", "--decode-step", "2")

    def test_no_run_local(self):
        os.unlink(self.rl)
        self.refused("no run-local at", "--run-local", self.model)

    def test_script_refuses(self):
        p = subprocess.run([sys.executable, "-B", SCRIPT, "--run-local", os.path.join(self.dir.name, "none")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.assertEqual(p.returncode, 1)
        self.assertIn("profile-decode: no checkpoint at", p.stderr)


if __name__ == "__main__":
    unittest.main()
