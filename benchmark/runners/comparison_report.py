"""The runner comparison's outputs: machine description, greedy-output check, table, plots."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

from airserve.srt.hardware import host_cpu


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict:
    try:
        import psutil

        memory_gib = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        memory_gib = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "cpu": host_cpu()[0],
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "memory_gib": memory_gib,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "openvino": _version("openvino"),
        "airserve": _version("airserve"),
        "git_commit": commit or None,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def compare_outputs(records: list[dict]) -> dict:
    """Greedy GSM8K output texts of every mode against the first mode that has them."""
    ran = [r for r in records if r.get("gsm8k")]
    if len(ran) < 2:
        return {"compared": [r["mode"] for r in ran], "identical": None,
                "note": "fewer than two modes have GSM8K outputs"}
    ref = ran[0]
    check = {"reference": ref["mode"], "compared": [r["mode"] for r in ran],
             "num_questions": len(ref["gsm8k"]["outputs"]), "differing_text": {},
             "differing_answer": {}}
    for r in ran[1:]:
        keys = sorted(set(ref["gsm8k"]["outputs"]) | set(r["gsm8k"]["outputs"]), key=int)
        check["differing_text"][r["mode"]] = [
            int(k) for k in keys
            if ref["gsm8k"]["outputs"].get(k) != r["gsm8k"]["outputs"].get(k)
        ]  # fmt: skip
        check["differing_answer"][r["mode"]] = [
            int(k) for k in keys if ref["gsm8k"]["preds"].get(k) != r["gsm8k"]["preds"].get(k)
        ]
    check["identical"] = not any(check["differing_text"].values())
    return check


def _fmt(value, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


HEADER = (
    "| mode | runner | concurrency | output tok/s | median ITL (ms) | p99 ITL (ms) "
    "| median TTFT (ms) | GSM8K accuracy | GSM8K invalid | GSM8K output tok/s "
    "| startup (s) | capture (s) | eager fallbacks |"
)


def _mode_cells(r: dict) -> list[str]:
    """Per-mode columns, written on the first row of each mode."""
    g = r.get("gsm8k") or {}
    fallbacks = r.get("eager_fallbacks")
    return [_fmt(g.get("accuracy"), 3), _fmt(g.get("invalid"), 3),
            _fmt(g.get("output_throughput")), _fmt(r.get("startup_s")),
            _fmt(r.get("capture_s")),
            "" if fallbacks is None or r.get("runner") == "eager"
            else str(sum(fallbacks.values()))]  # fmt: skip


def table_rows(records: list[dict]) -> list[str]:
    rows = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for r in records:
        if r["status"] in ("failed", "skipped", "interrupted", "pending") and not r["bench"]:
            reason = (r.get("error") or "").splitlines()[0][:120] if r.get("error") else ""
            rows.append(f"| {r['mode']} | **{r['status']}**: {reason} |" + " |" * 11)
            continue
        for i, b in enumerate(r["bench"]):
            first = [r["mode"], r.get("runner", "")] if i == 0 else ["", ""]
            if "error" in b and "completed" not in b:
                serving = [b["error"][:60], "", "", ""]
            else:
                failed = f" ({b['failed']} failed)" if b.get("failed") else ""
                serving = [_fmt(b["output_throughput"]) + failed, _fmt(b["median_itl_ms"], 2),
                           _fmt(b["p99_itl_ms"], 2), _fmt(b["median_ttft_ms"])]
            per_mode = _mode_cells(r) if i == 0 else [""] * 6
            rows.append("| " + " | ".join([*first, str(b["max_concurrency"]), *serving, *per_mode])
                        + " |")
    return rows


def check_lines(check: dict) -> list[str]:
    if check.get("identical") is None:
        return [f"Greedy GSM8K outputs: not compared ({check['note']})."]
    n = check["num_questions"]
    if check["identical"]:
        return [f"Greedy GSM8K outputs identical across {', '.join(check['compared'])}: "
                f"yes ({n} questions, output text compared)."]
    lines = [f"Greedy GSM8K outputs identical across {', '.join(check['compared'])}: **no**."]
    for mode, idx in check["differing_text"].items():
        answers = check["differing_answer"][mode]
        lines.append(f"- {mode} vs {check['reference']}: text differs on {len(idx)} of {n} "
                     f"questions (row indices {idx}); extracted answer differs on "
                     f"{len(answers)} ({answers})")
    return lines


def write_markdown(results: dict, path: Path) -> str:
    m, c = results["machine"], results["config"]
    model = next((r.get("model_path") for r in results["modes"] if r.get("model_path")), None)
    model = os.path.basename(model.rstrip("/")) if model else "?"  # the file, not this machine
    threads = c["num_threads"] or "torch default"
    lines = [
        "## Runner comparison", "",
        f"Machine: {m['cpu']}, {m['cpus_usable']} CPUs usable, {m['memory_gib']} GiB; "
        f"{m['os']}; torch {m['torch']}, openvino {m['openvino']}; airserve {m['airserve']} "
        f"({m['git_commit']}). Server threads: {threads}. Model: {model}.", "",
        f"Load: `bench_serving` random, input {c['input_len']} / output {c['output_len']} "
        f"tokens (range ratio {c['range_ratio']}), ignore_eos, "
        f"{c['num_prompts'] or 'max(16, 4 x concurrency)'} prompts per concurrency. "
        f"GSM8K: {c['gsm8k_questions']} questions, {c['gsm8k_shots']} shots, greedy, "
        f"parallel {c['gsm8k_parallel']}, max {c['gsm8k_max_new_tokens']} new tokens. "
        "Startup is process start to ready (load, capture, warm-up); capture is the graph "
        "runner's own total; eager fallbacks count decode batches the runner could not take.",
        "", *table_rows(results["modes"]), "", *check_lines(results["gsm8k_check"]), "",
    ]  # fmt: skip
    text = "\n".join(lines)
    path.write_text(text, encoding="utf-8")
    return text


def _series(record: dict, key: str) -> tuple[list[int], list[float]]:
    points = [(b["max_concurrency"], b[key]) for b in record["bench"]
              if b.get("completed")]  # fmt: skip
    return [x for x, _ in points], [y for _, y in points]


def plot_results(results: dict, out_dir: Path) -> list[Path]:
    """output_throughput.png and median_itl.png: one line per mode against concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = results["config"]
    load = f"random {c['input_len']} in / {c['output_len']} out"
    paths = []
    for key, ylabel, name in [
        ("output_throughput", "output tokens/s", "output_throughput.png"),
        ("median_itl_ms", "median inter-token latency (ms)", "median_itl.png"),
    ]:
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
        for r in results["modes"]:
            xs, ys = _series(r, key)
            if xs:
                runner = r.get("runner") or r["mode"]
                label = r["mode"] if runner == r["mode"] else f"{r['mode']} ({runner})"
                ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_xticks(c["concurrency"], [str(x) for x in c["concurrency"]])
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel} vs concurrency ({load})")
        ax.grid(True, which="major", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / name)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths
