"""docs/benchmarks.md keeps the figures of benchmarks not re-run here (a fresh clone has no
bench-results/ of the others)."""

from tools.bench.__main__ import earlier_sections, render

PAGE = """# Benchmarks

## Old engine figures

Command: `python -m tools.bench engine` — x86_64, 2 cores, Linux, 2026-11-24.

| metric | value | note |
| --- | --- | --- |
| tokens/s | 351 | |

## Weight sync

Command: `make bench  (python -m tools.bench weight_sync)` — x86_64.
"""


def test_running_one_benchmark_keeps_the_others_sections() -> None:
    earlier = earlier_sections(PAGE, {"engine"})
    assert list(earlier) == ["weight_sync"]
    fresh = {
        "name": "engine",
        "title": "New engine figures",
        "command": "python -m tools.bench engine",
        "machine": "m",
        "date": "d",
        "rows": [["tokens/s", "400", ""]],
    }
    page = render([fresh], earlier)
    assert "New engine figures" in page and "Old engine figures" not in page
    assert "## Weight sync" in page and page.index("New engine") < page.index("Weight sync")


def test_a_benchmark_run_on_a_gpu_keeps_its_own_section_beside_the_cpu_one() -> None:
    cuda = {
        "name": "spec_cuda",
        "title": "Spec on a GPU",
        "command": "python -m tools.bench spec (on a CUDA machine)",
        "machine": "m",
        "date": "d",
        "rows": [["speedup", "1.03x", ""]],
    }
    page = render([cuda], earlier_sections(PAGE, {"spec_cuda"}))
    # re-running the CPU benchmark of the same command keeps the GPU section
    earlier = earlier_sections(page, {"spec"})
    assert "spec_cuda" in earlier and "Spec on a GPU" in earlier["spec_cuda"]
