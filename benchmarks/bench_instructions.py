"""The library's own client work per leased task, counted in instructions (callgrind).

``bench_overhead.py`` times CPU, and on a shared 2-core box its figures move by 2x between runs
(the bare Redis floor alone read 73-201 us per task in one sitting): too noisy to judge a cut of
10-20 us. This script counts instead. It runs ``bench_overhead.py``'s tracer runner (each task
through ``celery.app.trace.build_tracer``, in one process) under
``valgrind --tool=callgrind`` against real servers, and counts the user-space instructions this
process executes per task, for plain Celery, the floor (the same two round trips done directly
with the driver: ``SET NX PX`` + ``DEL``; ``UPDATE ... RETURNING`` + ``UPDATE``) and the lease
variants. Instrumentation is switched on (``callgrind_control -i on``) only around each
variant's timed tasks, after a warm-up, so imports, connections and caches do not count.

``beyond floor`` = variant - plain Celery - floor: the library's own Python (and the part of
the driver its longer commands and replies cost). The count repeats to within about 0.5 % on a
loaded machine. It is turned into microseconds with a calibration made in the same run, outside
valgrind: the plain tracer's instructions per task divided by its own CPU time per task (the
fastest of many samples of 200 tasks, taken before and all the while the counting runs: other
load only ever makes a sample slower, so the fastest one is the machine's own speed). The
estimate covers the client's user-space work only: the server's work (Lua, SQL) and the
kernel's (system calls) are not counted; see ``bench_overhead.py`` for those. It is a lower
bound: the plain tracer is a hot loop, while a leased task hands the core to the server and
back twice, and its Python runs on cold caches: on the 2-core development box the same
instructions took 3-5x as long in that flow (store calls alone: 1,900-3,400 instructions per us
of user CPU against the tracer's 8,000-10,000). Compare counts, not estimates, between versions.

    .venv/bin/python benchmarks/bench_instructions.py                 # starts its own servers
    .venv/bin/python benchmarks/bench_instructions.py --stores redis --tasks 200 --json /tmp/i.json
    .venv/bin/python benchmarks/bench_instructions.py --redis-url redis://127.0.0.1:6380/0 \\
        --postgres-url postgresql+psycopg://postgres@127.0.0.1:5432/bench

Needs ``valgrind`` (with ``callgrind_control``) on PATH. A measurement, not a test: it exits 0
whatever the figures are.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # tests.tooling.servers lives in the repository, not the package
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_overhead import (  # noqa: E402 - ROOT first
    build_app,
    postgres_floor,
    redis_floor,
    start_servers,
    tracer_runner,
)

VARIANTS = {  # variant -> (store, tracer task or None for the floor)
    "plain": (None, "o.plain"),
    "redis_floor": ("redis", None),
    "redis": ("redis", "o.redis"),
    "redis_id": ("redis", "o.redis_id"),
    "postgres_floor": ("postgres", None),
    "postgres": ("postgres", "o.postgres"),
    "postgres_id": ("postgres", "o.postgres_id"),
}
WARMUP = 100  # untimed tasks per variant before counting: connections, scripts, caches


def runners(
    app: Any, names: list[str], redis_url: str | None, postgres_url: str | None
) -> dict[str, Callable[[int], None]]:
    out: dict[str, Callable[[int], None]] = {}
    for name in names:
        store, task = VARIANTS[name]
        if task is not None:
            out[name] = tracer_runner(app, task)
        elif store == "redis":
            assert redis_url
            out[name] = redis_floor(redis_url)
        else:
            assert postgres_url
            out[name] = postgres_floor(postgres_url)
    return out


# -- inside valgrind ----------------------------------------------------------------------------
def child(args: argparse.Namespace) -> int:
    names = args.variants.split(",")
    app = build_app(args.redis_url, args.postgres_url)
    runs = runners(app, names, args.redis_url, args.postgres_url)
    for run in runs.values():
        run(WARMUP)
    pid = str(os.getpid())

    def control(*opts: str) -> None:
        subprocess.run(
            ["callgrind_control", *opts, pid],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    for name, run in runs.items():
        run(5)  # the same code paths hot right before counting
        control("-z")
        control("-i", "on")
        run(args.tasks)
        control("-i", "off")
        control("-d", name)
    return 0


def read_dumps(out_base: Path) -> dict[str, int]:
    """Total instructions per dump, keyed by the variant named in the dump's trigger."""
    totals = {}
    for path in sorted(out_base.parent.glob(out_base.name + ".*")):
        text = path.read_text(errors="replace")
        trigger = re.search(r"^desc: Trigger: dump (\S+)", text, re.M)
        total = re.search(r"^totals: (\d+)", text, re.M) or re.search(
            r"^summary: (\d+)", text, re.M
        )
        if trigger and total:
            totals[trigger.group(1)] = int(total.group(1))
    return totals


def count(
    names: list[str],
    tasks: int,
    redis_url: str | None,
    postgres_url: str | None,
    while_waiting: Callable[[], None],
) -> dict[str, float]:
    """Instructions per task for each variant, from one process under callgrind.

    ``while_waiting`` is called again and again until that process ends.
    """
    with tempfile.TemporaryDirectory(prefix="celery_lease_instr_") as tmp:
        out_base = Path(tmp) / "callgrind.out"
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={out_base}",
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            "--tasks",
            str(tasks),
            "--variants",
            ",".join(names),
        ]
        if redis_url:
            cmd += ["--redis-url", redis_url]
        if postgres_url:
            cmd += ["--postgres-url", postgres_url]
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        log = Path(tmp) / "valgrind.log"
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
            try:
                while proc.poll() is None:
                    while_waiting()
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        if proc.returncode != 0:
            sys.stderr.write(log.read_text(errors="replace"))
            raise SystemExit(f"the run under valgrind failed (exit {proc.returncode})")
        totals = read_dumps(out_base)
    missing = set(names) - set(totals)
    if missing:
        raise SystemExit(f"no callgrind dump for {sorted(missing)}")
    return {name: totals[name] / tasks for name in names}


class Calibration:
    """The plain tracer's CPU microseconds per task outside valgrind, in many short samples.

    Other work on the machine only ever slows a sample down (a busy sibling hyperthread, a
    cold cache), so the fastest sample is the machine's own speed; sampling all the while the
    counting runs gives the fast moments of a loaded box a chance to show.
    """

    SAMPLE = 200  # tasks per sample

    def __init__(self, run: Callable[[int], None]) -> None:
        self.run = run
        self.samples: list[float] = []
        run(2000)  # warm up

    def sample(self) -> None:
        c0 = time.process_time()
        self.run(self.SAMPLE)
        self.samples.append((time.process_time() - c0) / self.SAMPLE * 1e6)

    def sample_and_pause(self) -> None:
        """One sample, then a pause: most of a core stays free for the run under valgrind."""
        self.sample()
        time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="redis,postgres", help="comma list: redis,postgres")
    parser.add_argument("--tasks", type=int, default=300, help="counted tasks per variant")
    parser.add_argument(
        "--calibration-samples",
        type=int,
        default=100,
        help="timed samples of 200 plain tasks before the counting (more run during it)",
    )
    parser.add_argument("--redis-url", help="use this Redis instead of starting one")
    parser.add_argument("--postgres-url", help="use this PostgreSQL instead of starting one")
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON to PATH")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variants", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    stores = [s for s in args.stores.split(",") if s]
    bad = set(stores) - {"redis", "postgres"}
    if bad:
        parser.error(f"unknown store(s) {sorted(bad)}: choose from redis, postgres")
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is not on PATH (install valgrind)")
    names = [n for n, (store, _) in VARIANTS.items() if store is None or store in stores]

    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        redis_url, postgres_url, _ = start_servers(stack, stores, args.redis_url, args.postgres_url)
        calibration = Calibration(tracer_runner(build_app(redis_url, postgres_url), "o.plain"))
        for _ in range(args.calibration_samples):
            calibration.sample()
        per_task = count(names, args.tasks, redis_url, postgres_url, calibration.sample_and_pause)
    plain_us = min(calibration.samples)

    per_us = per_task["plain"] / plain_us  # instructions per microsecond of this machine
    print(
        f"client instructions per task under callgrind ({args.tasks} tasks per variant), "
        f"k = 1,000\ncalibration: plain Celery's tracer {per_task['plain'] / 1e3:.1f}k "
        f"instructions in {plain_us:.2f} us CPU per task (fastest of "
        f"{len(calibration.samples)} samples of {Calibration.SAMPLE}, median "
        f"{statistics.median(calibration.samples):.2f} us): {per_us:.0f} instructions per us\n"
    )
    print(f"{'variant':16} {'instr':>9} {'over plain':>11} {'beyond floor':>13} {'~us beyond':>11}")
    report: dict[str, Any] = {
        "tasks": args.tasks,
        "calibration": {
            "plain_us_per_task": plain_us,
            "instructions_per_us": per_us,
            "samples_us_per_task": calibration.samples,
        },
        "variants": {},
    }
    for name in names:
        store, _ = VARIANTS[name]
        over = per_task[name] - per_task["plain"] if name != "plain" else None
        if name.endswith("_floor") or name == "plain":
            over = None
        floor = per_task.get(f"{store}_floor") if store else None
        beyond = over - floor if over is not None and floor is not None else None
        est = beyond / per_us if beyond is not None else None
        print(
            f"{name:16} {per_task[name] / 1e3:8.1f}k "
            f"{'' if over is None else f'{over / 1e3:10.1f}k':>11} "
            f"{'' if beyond is None else f'{beyond / 1e3:12.1f}k':>13} "
            f"{'' if est is None else f'{est:11.1f}':>11}"
        )
        report["variants"][name] = {
            "instructions_per_task": per_task[name],
            "over_plain": over,
            "beyond_floor": beyond,
            "beyond_floor_us": est,
        }
    print(
        "\nover plain: minus plain Celery's tracer; beyond floor: also minus the floor (the same "
        "two round trips\nwith the bare driver); ~us beyond: beyond floor at the plain tracer's "
        "speed (client user-space only),\na lower bound: in a task's flow, between round trips, "
        "the same instructions run 3-5x slower (cold caches).\n"
        f"wall time {time.monotonic() - started:.0f} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
