"""Mutation testing of minipar's engines with cosmic-ray, sampled, each module against its own tests.

    pip install "cosmic-ray>=8.4"
    python tests/mutation/run.py                      # every target, 12 sampled mutants each (seed 0)
    python tests/mutation/run.py optim compression --sample 40

For each target it copies the working tree to --workdir (the mutants are written into that copy's files,
never into yours), lets cosmic-ray list every mutant of the target's modules, keeps a seeded random sample of
the mutants that change arithmetic, comparisons, constants, branches or loops (cosmic-ray's ten replacements
of each binary operator become its four arithmetic ones: + − × ÷ — the bit-shift and bitwise variants of a
float expression only crash), runs the target's tests against each and prints a markdown table of the score
per target and every surviving mutant's diff. A mutant whose tests time out counts as killed: the suite's
own timeouts caught it. docs/testing.md holds the last report and says which survivors are equivalent.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTEST = f"{sys.executable} -m pytest -x -q -p no:cacheprovider"

# target -> (modules, the tests that cover them: the smallest set that exercises every mode of the module)
TARGETS = {
    "optim": (["minipar/optim.py"],
              "tests/test_data_optim.py tests/test_mixed_precision.py -k 'adamw or zero_masters or overflow or optim "
              "or clip or cosine or sgd or resume'"),
    "compression": (["minipar/parallel/compression.py", "minipar/parallel/local_sgd.py"],
                    "tests/test_compression_local_sgd.py"),
    "checkpoint": (["minipar/checkpoint.py"], "tests/test_checkpoint.py"),
    "collectives": (["minipar/comm/collectives.py"], "tests/test_collectives.py -k 'match_mpi or debug'"),
    "communicator": (["minipar/comm/communicator.py"], "tests/test_collectives.py"),
    "ops": (["minipar/ops.py"], "tests/test_ops.py tests/test_autograd.py"),
    "data_parallel": (["minipar/parallel/data_parallel.py"], "tests/test_data_parallel.py tests/test_expert_parallel.py"),
    "zero": (["minipar/parallel/zero.py"], "tests/test_data_parallel.py tests/test_mixed_precision.py::"
             "test_zero_masters_equal_adamw_bit_for_bit tests/test_mixed_precision.py::test_model_state_is_the_papers_table"),
    "tensor_parallel": (["minipar/parallel/tensor_parallel.py"],
                        "tests/test_tensor_parallel.py tests/test_sequence_parallel.py"),
    "context_parallel": (["minipar/parallel/context_parallel.py"], "tests/test_context_parallel.py"),
    "pipeline": (["minipar/parallel/pipeline.py", "minipar/parallel/schedules.py"],
                 "tests/test_schedules.py tests/test_pipeline.py"),
    "expert_parallel": (["minipar/parallel/expert_parallel.py", "minipar/models/moe.py"],
                        "tests/test_moe.py tests/test_expert_parallel.py"),
    "gpt": (["minipar/models/gpt.py"], "tests/test_recompute.py tests/test_gpt.py"),  # recomputation, config, generate
    "llama": (["minipar/models/llama.py"], "tests/test_llama.py tests/test_planner.py::"
              "test_the_planners_parameters_per_rank_are_the_engines"),
    "autograd": (["minipar/autograd.py", "minipar/nn.py"],  # + split backward through recomputation, autocast
                 "tests/test_autograd.py tests/test_ops.py tests/test_gpt.py tests/test_recompute.py "
                 "-k 'not training_matches and not refused'"),
    "layout": (["minipar/parallel/layout.py", "minipar/parallel/mesh.py", "minipar/parallel/validation.py"],
               "tests/test_validation.py tests/test_composition.py tests/test_planner.py "
               "tests/test_expert_parallel.py::test_hybrid_sharding_groups_for_experts "
               "tests/test_readme.py::test_the_composition_table_is_layouts "
               "'tests/test_context_parallel.py::test_matches_single_process[layout0-ring-zigzag]'"),
    "placement": (["minipar/placement.py"], "tests/test_placement.py tests/test_composition.py"),
    "planner": (["minipar/parallel/planner.py"], "tests/test_planner.py"),
    "tuning": (["minipar/comm/tuning.py"], "tests/test_collectives.py -k 'cost_model or two_hosts or hierarchical'"),
    "safetensors": (["minipar/safetensors_io.py"],
                    "tests/test_hf_interop.py tests/test_gpt.py tests/test_llama.py -k 'not every_axis and not reshards'"),
    "data": (["minipar/data.py"], "tests/test_data_optim.py tests/test_hf_interop.py tests/test_gpt.py"),
    "trace": (["minipar/trace.py"], "tests/test_trace.py"),
    "kernels": (["minipar/kernels/flash_attention.py", "minipar/kernels/matmul.py", "minipar/kernels/adapter.py"],
                "tests/test_kernels.py"),  # ./kernels, where the copy installs it (copy_tree)
    "backend": (["minipar/backend.py"], "tests/test_data_optim.py tests/test_ops.py tests/test_kernels.py"),
    "cli": (["minipar/cli.py"], "tests/test_cli.py"),
    "precision": (["minipar/precision.py"], "tests/test_precision.py -k 'not layouts and not bad_fp8_flags'"),
}
KEPT = re.compile(r"ReplaceBinaryOperator_\w+_(Add|Sub|Mul|Div)$|ReplaceComparisonOperator|AddNot|NumberReplacer|"
                  r"Replace(True|False|And|Or|Break|Continue)|ZeroIterationForLoop|ExceptionReplacer|"
                  r"ReplaceUnaryOperator|RemoveDecorator")
CONFIG = """[cosmic-ray]
module-path = {modules}
timeout = {timeout}
excluded-modules = []
test-command = "{command}"
[cosmic-ray.distributor]
name = "local"
"""


def copy_tree(workdir: str) -> None:
    """The working tree as git sees it (tracked and untracked, not ignored files) into ``workdir``."""
    shutil.rmtree(workdir, ignore_errors=True)
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        if os.path.isfile(os.path.join(ROOT, name)):
            # ./kernels is the package minipar.kernels (setup.py's package_dir): in the copy it sits under minipar/,
            # where the copy's minipar imports it, instead of the editable install's ./kernels of the working tree
            target = os.path.join("minipar", name) if name.startswith("kernels/") else name
            os.makedirs(os.path.join(workdir, os.path.dirname(target)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), os.path.join(workdir, target))


def run_target(name: str, workdir: str, sample: int, seed: int, timeout: float) -> dict:
    from cosmic_ray.work_db import use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    modules, tests = TARGETS[name]
    config, session = os.path.join(workdir, f"{name}.toml"), os.path.join(workdir, f"{name}.sqlite")
    with open(config, "w", encoding="utf-8") as f:
        f.write(CONFIG.format(modules="[" + ", ".join(f'"{m}"' for m in modules) + "]", timeout=timeout,
                              command=f"{PYTEST} {tests}".replace('"', '\\"')))
    env = {**os.environ, "PYTHONPATH": workdir}  # the ranks, too, import the mutated copy
    subprocess.run(["cosmic-ray", "init", config, session], cwd=workdir, env=env, check=True)
    with use_db(session) as db:
        items = list(db.work_items)
        eligible = [i for i in items if KEPT.search(i.mutations[0].operator_name)]
        chosen = {i.job_id for i in random.Random(seed).sample(eligible, min(sample, len(eligible)))}
        for item in items:
            if item.job_id not in chosen:
                db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
    subprocess.run(["cosmic-ray", "exec", config, session], cwd=workdir, env=env, check=True)
    killed, survived = 0, []
    with use_db(session) as db:
        by_id = {i.job_id: i for i in db.work_items}
        for job_id, result in db.results:
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                continue
            if result.test_outcome == TestOutcome.SURVIVED:
                survived.append((by_id[job_id], result.diff))
            else:  # killed, a crash, or a timeout (the suite's own timeouts caught the mutant)
                killed += 1
    return {"eligible": len(eligible), "all": len(items), "killed": killed, "survived": survived}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", metavar="TARGET", help=f"which (default: all): {', '.join(TARGETS)}")
    parser.add_argument("--sample", type=int, default=12, help="mutants per target")
    parser.add_argument("--seed", type=int, default=0, help="which sample")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant before it counts as killed")
    parser.add_argument("--workdir", default=os.path.join("/tmp", "minipar-mutation"), help="the copy to mutate")
    args = parser.parse_args()
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        parser.error(f"unknown target {unknown[0]!r}: choose from {', '.join(TARGETS)}")
    copy_tree(args.workdir)
    rows, survivors = [], []
    for name in args.targets or TARGETS:
        r = run_target(name, args.workdir, args.sample, args.seed, args.timeout)
        tried = r["killed"] + len(r["survived"])
        rows.append(f"| {name} | {r['all']} | {r['eligible']} | {tried} | {r['killed']} | {len(r['survived'])} | "
                    f"{r['killed'] / max(tried, 1):.0%} |")
        survivors += [(name, item, diff) for item, diff in r["survived"]]
        print(rows[-1], flush=True)
    print("\n| target | mutants | kept | sampled | killed | survived | score |\n|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    for name, item, diff in survivors:
        m = item.mutations[0]
        print(f"\n{name}: {m.operator_name} at {m.module_path}:{m.start_pos[0]} ({m.definition_name})\n{diff}")


if __name__ == "__main__":
    main()
