"""Run every benchmark of the project one after another and write ``benchmarks/RESULTS.md``.

    .venv/bin/python -m benchmarks.run_all [--only beat,worker] [--timeout 1800]

Each ``benchmarks/<name>.py`` (except this file and ``_private`` modules) runs as
``python -m benchmarks.<name>`` from the repository root, in its own process, with no
arguments: its defaults are the published configuration. The benchmarks start their own private
servers and anchors (stock Celery, celery-redbeat from the ``bench`` extra, raw kombu
``send_task``), so one run compares everything on the same machine under the same load.

RESULTS.md holds:

* the machine (CPU model, cores, memory, kernel, load average before the run) and the versions
  (Python, Celery, kombu, redis-py, python-etcd3, grpcio, protobuf and its implementation,
  celery-redbeat, redis-server, etcd, and the git commit of celery-crawl);
* the tables of figures and ratios: every Markdown table a benchmark printed, and every
  aligned-text table with a ``ratio`` column, copied as Markdown tables;
* each benchmark's full output, its command, exit status and duration.

Benchmarks are not tests: a failing one is reported in its section and in the summary, and the
others still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
#: Run first the cheap ones, so a late timeout costs the least.
ORDER = ("schedules", "leases", "backend", "throughput", "worker", "beat")


@dataclasses.dataclass
class Outcome:
    name: str
    command: str
    returncode: int | None
    seconds: float
    stdout: str
    stderr: str

    @property
    def status(self) -> str:
        if self.returncode is None:
            return "timed out"
        return "ok" if self.returncode == 0 else f"failed (exit {self.returncode})"


def discover() -> list[str]:
    """Benchmark module names in ``benchmarks/``, in ``ORDER`` first, then alphabetically."""
    names = sorted(p.stem for p in HERE.glob("*.py")
                   if not p.stem.startswith("_") and p.stem != "run_all")
    return sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))


def run_one(name: str, timeout_s: float) -> Outcome:
    args = [sys.executable, "-m", f"benchmarks.{name}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s, start_new_session=True)
        code: int | None = proc.returncode
        out, err = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = None
        out = _text(exc.stdout)
        err = _text(exc.stderr) + f"\n[timed out after {timeout_s:.0f}s]"
    return Outcome(name, " ".join(["python", "-m", f"benchmarks.{name}"]), code,
                   time.monotonic() - t0, out, err)


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


# -- machine and versions ------------------------------------------------------------------------
def machine() -> list[tuple[str, str]]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "unknown"
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 1024 / 1024:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return [
        ("CPU", f"{cpu} ({os.cpu_count()} logical cores)"),
        ("memory", mem),
        ("kernel", f"{platform.system()} {platform.release()}"),
        ("load average before the run (1, 5, 15 min)", load),
        ("date (UTC)", datetime.now(UTC).strftime("%Y-%m-%d %H:%M")),
    ]


def _dist(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _protobuf_kind() -> str:
    """protobuf's implementation in a fresh interpreter (the benchmarks' default)."""
    try:
        out = subprocess.run([sys.executable, "-c", "from google.protobuf.internal import "
                              "api_implementation as a; print(a.Type())"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "not installed"


def _binary(cmd: list[str], pattern: str) -> str:
    if cmd[0] == "redis-server":  # the one the benchmarks start (the system one first)
        from celery_crawl.errors import ConfigError
        from celery_crawl.up import find_redis_server

        try:
            exe: str | None = find_redis_server()
        except ConfigError:
            exe = None
    else:
        exe = shutil.which(cmd[0])
    if exe is None:
        return "not installed"
    try:
        out = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    match = re.search(pattern, out.stdout + out.stderr)
    return match.group(1) if match else "unknown"


def versions() -> list[tuple[str, str]]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return [
        ("celery-crawl", f"{_dist('celery-crawl')} (git {commit or 'unknown'})"),
        ("Python", platform.python_version()),
        ("celery", _dist("celery")),
        ("kombu", _dist("kombu")),
        ("redis-py", _dist("redis")),
        ("etcd3 (python)", _dist("etcd3")),
        ("grpcio", _dist("grpcio")),
        ("protobuf", f"{_dist('protobuf')} ({_protobuf_kind()})"),
        ("celery-redbeat (anchor)", _dist("celery-redbeat")),
        ("redis-server", _binary(["redis-server", "--version"], r"v=(\S+)")),
        ("etcd", _binary(["etcd", "--version"], r"etcd Version: (\S+)")),
    ]


# -- tables with ratios --------------------------------------------------------------------------
_SEP = re.compile(r"^[\s|:+-]+$")


def _chunks(line: str) -> list[tuple[int, int, str]]:
    """Runs of text separated by 2+ spaces, with their start and end columns."""
    return [(m.start(), m.end(), m.group(0).strip())
            for m in re.finditer(r"\S+(?: \S+)*", line)]


def _cells(line: str, header: str | None = None) -> list[str]:
    """Cells of a Markdown row, or of an aligned-text row placed under ``header``'s columns
    (a row may leave a column empty, e.g. no ratio for a figure that has no anchor)."""
    if line.strip().startswith("|"):
        return [c.strip() for c in line.strip().strip("|").split("|")]
    if header is None:
        return [text for _, _, text in _chunks(line)]
    spans = _chunks(header)
    cells = [""] * len(spans)
    for start, end, text in _chunks(line):
        def fit(k: int, start: int = start, end: int = end) -> tuple[int, int]:
            s, e, _ = spans[k]
            return max(0, min(end, e) - max(start, s)), -abs((start + end) - (s + e))

        best = max(range(len(spans)), key=fit)
        cells[best] = f"{cells[best]} {text}".strip()
    return cells


def figure_tables(output: str) -> list[list[list[str]]]:
    """The result tables in ``output``, as lists of rows of cells: every Markdown table, and
    every aligned-text table whose header has a ``ratio`` column.

    A table is a header line (Markdown ``| a | b |`` or columns separated by 2+ spaces) followed
    by rows with the same number of cells; separator lines (``---``, ``|---|``) are skipped and
    the table ends at the first line that does not fit.
    """
    tables: list[list[list[str]]] = []
    lines = output.splitlines()
    i = 0
    while i < len(lines):
        header_line = lines[i]
        markdown = header_line.strip().startswith("|")
        header = _cells(header_line)
        has_ratio = any(re.search(r"(?i)\bratio", c) for c in header)
        if len(header) >= 2 and (markdown or (len(header) >= 3 and has_ratio)):
            rows = [header]
            j = i + 1
            while j < len(lines):
                line = lines[j]
                if not line.strip():
                    break
                if _SEP.match(line):
                    j += 1
                    continue
                if line.strip().startswith("|") != markdown:
                    break
                cells = _cells(line, None if markdown else header_line)
                if len(cells) != len(header):
                    break
                rows.append(cells)
                j += 1
            if len(rows) > 1 and rows not in tables:
                tables.append(rows)
            i = j
        else:
            i += 1
    return tables


def _md_table(rows: list[list[str]]) -> list[str]:
    def esc(cell: str) -> str:
        return cell.replace("|", "\\|")

    out = ["| " + " | ".join(esc(c) for c in rows[0]) + " |",
           "|" + "|".join("---" for _ in rows[0]) + "|"]
    out.extend("| " + " | ".join(esc(c) for c in r) + " |" for r in rows[1:])
    return out


def _body(output: str) -> list[str]:
    """A benchmark's stdout for Markdown: its Markdown tables as they are, the rest as text."""
    if not output.strip():
        return ["(no output)"]
    blocks: list[str] = []
    text: list[str] = []

    def flush() -> None:
        if any(t.strip() for t in text):
            blocks.extend(["```text", *text, "```"])
        text.clear()

    for line in output.rstrip().splitlines():
        if line.lstrip().startswith("|"):
            flush()
            blocks.append(line.strip())
        elif line.lstrip().startswith("#"):
            flush()
            # a benchmark's own heading, nested under its section
            blocks.extend(["", "#### " + line.lstrip("# ").strip(), ""])
        else:
            if blocks and blocks[-1].startswith("|") and not text:
                blocks.append("")
            text.append(line)
    flush()
    return blocks


def render(outcomes: list[Outcome], started: list[tuple[str, str]]) -> str:
    lines = ["# Benchmark results", "",
             "Written by `python -m benchmarks.run_all`: every benchmark of the project run one "
             "after another on one machine, each against its anchors (stock Celery, "
             "celery-redbeat, raw kombu `send_task`). Figures depend on the machine and its "
             "load; the ratios are the comparable part.", "",
             "## Machine", "", "| | |", "|---|---|"]
    lines.extend(f"| {k} | {v} |" for k, v in started)
    lines.extend(["", "## Versions", "", "| | |", "|---|---|"])
    lines.extend(f"| {k} | {v} |" for k, v in versions())
    lines.extend(["", "## Summary", "", "| benchmark | status | duration |", "|---|---|---:|"])
    lines.extend(f"| `{o.name}` | {o.status} | {o.seconds:.0f} s |" for o in outcomes)
    lines.extend(["", "## Figures and ratios", ""])
    any_table = False
    for o in outcomes:
        for table in figure_tables(o.stdout):
            any_table = True
            lines.extend([f"**{o.name}**", "", *_md_table(table), ""])
    if not any_table:
        lines.extend(["(no benchmark printed a result table)", ""])
    lines.extend(["## Full output", ""])
    for o in outcomes:
        lines.extend([f"### {o.name}", "", f"`{o.command}` — {o.status}, {o.seconds:.0f} s", ""])
        lines.extend(_body(o.stdout))
        if o.returncode != 0 and o.stderr.strip():
            tail = o.stderr.strip().splitlines()[-30:]
            lines.extend(["", "stderr (last lines):", "", "```text", *tail, "```"])
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated benchmark names")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per benchmark, seconds")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    names = discover()
    if args.only:
        wanted = {n.strip() for n in args.only.split(",") if n.strip()}
        unknown = wanted - set(names)
        if unknown:
            parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))} "
                         f"(found: {', '.join(names)})")
        names = [n for n in names if n in wanted]
    started = machine()
    outcomes = []
    for name in names:
        print(f"running benchmarks.{name} ...", flush=True)
        outcome = run_one(name, args.timeout)
        print(f"  {outcome.status} in {outcome.seconds:.0f}s", flush=True)
        outcomes.append(outcome)
    args.output.write_text(render(outcomes, started))
    print(f"wrote {args.output}")
    return 0 if all(o.returncode == 0 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
