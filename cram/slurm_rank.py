"""One Slurm task per training process: run a recipe as rank $SLURM_PROCID, with the environment `accelerate launch`
would give that rank, and no launcher process between Slurm and the rank.

    srun --ntasks-per-node=P python -m cram.slurm_rank --config_file CONFIG --main_process_ip ADDR \\
        --main_process_port PORT recipes/pythia.py ARGS

The job scripts `python -m cram.slurm` writes start their ranks this way. Under `accelerate launch`, torchrun's
agent stands between Slurm and the ranks: it answers a signal by passing it on and killing the ranks 30 s later
(torch's TORCH_ELASTIC_SHUTDOWN_TIMEOUT sets another wait only from 2.12), so a longer state write was cut short;
and it dies of SIGUSR1, the time limit's notice. Here Slurm signals the ranks themselves, which save and leave.

The launch config is read by Accelerate's own launch parser, and the variables come from the functions its launchers
use (`prepare_multi_gpu_env`, `prepare_deepspeed_cmd_env`, `prepare_simple_launcher_cmd_env`): DeepSpeed's, FSDP's,
mixed precision's and compilation's settings are those `accelerate launch` would set. The rank's place comes from
Slurm (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_NODEID, SLURM_NNODES), in torchrun's variables.
"""

from __future__ import annotations

import os
import sys
from unittest import mock

from cram.errors import UserError, run_cli

# Slurm's variables for a task's place, which srun sets in every task's environment.
SLURM_PLACE = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID", "SLURM_NNODES")


def slurm_place(environment: dict[str, str]) -> dict[str, int]:
    """This task's rank, local rank, world size, node rank and node count, from srun's variables."""
    missing = [name for name in SLURM_PLACE if not environment.get(name, "").isdigit()]
    if missing:
        raise UserError(f"{', '.join(missing)} not set: python -m cram.slurm_rank runs as a task that srun starts, "
                        "one per training process (the job scripts python -m cram.slurm writes do so).")
    return {name: int(environment[name]) for name in SLURM_PLACE}


def launch_environment(launch_words: list[str]) -> tuple[dict[str, str], str, list[str], str, int]:
    """For `accelerate launch LAUNCH_WORDS` (its options, then the script and its arguments): the environment it gives
    its processes, less the rank's place; the script; its arguments; the main process's address and port."""
    import accelerate.utils.launch as accelerate_launch
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(launch_words)
    args, defaults, precision_from_config_flag = _validate_launch_command(args)
    # The launchers check that the main port is free on the main machine before they start torchrun, which binds it
    # later; here the main rank binds it itself, and a second task on that machine would find it taken.
    with mock.patch.object(accelerate_launch, "is_port_in_use", lambda port: False):
        if args.use_deepspeed and not args.cpu:
            # As `accelerate launch` does before its DeepSpeed launcher (accelerate/commands/launch.py, launch_command).
            fields = list(defaults.deepspeed_config.keys()) if defaults else []
            if precision_from_config_flag:
                fields.append("mixed_precision")
            args.deepspeed_fields_from_accelerate_config = ",".join(fields)
            environment = accelerate_launch.prepare_deepspeed_cmd_env(args)[1]
        elif (args.use_fsdp or args.multi_gpu) and not args.cpu:
            environment = accelerate_launch.prepare_multi_gpu_env(args)
        else:
            environment = accelerate_launch.prepare_simple_launcher_cmd_env(args)[1]
    return (environment, args.training_script, list(args.training_script_args), args.main_process_ip or "127.0.0.1",
            int(args.main_process_port or 29500))


def rank_environment(environment: dict[str, str], place: dict[str, int], main_address: str,
                     main_port: int) -> dict[str, str]:
    """`environment` with torchrun's variables for this task's place (torch/distributed/elastic/agent/server/
    local_elastic_agent.py, `_start_workers`), so the rank joins the group as a torchrun worker would."""
    processes, nodes = place["SLURM_NTASKS"], place["SLURM_NNODES"]
    if processes % nodes:
        raise UserError(f"srun started {processes} tasks on {nodes} nodes, which do not split evenly: start the same "
                        "number of tasks on every node (--ntasks-per-node).")
    per_node = processes // nodes
    ranks = {
        "RANK": place["SLURM_PROCID"], "LOCAL_RANK": place["SLURM_LOCALID"], "WORLD_SIZE": processes,
        "LOCAL_WORLD_SIZE": per_node, "GROUP_RANK": place["SLURM_NODEID"], "GROUP_WORLD_SIZE": nodes,
        "ROLE_RANK": place["SLURM_PROCID"], "ROLE_WORLD_SIZE": processes, "MASTER_ADDR": main_address,
        "MASTER_PORT": main_port,
    }
    result = {**environment, **{name: str(value) for name, value in ranks.items()}, "ROLE_NAME": "default"}
    if per_node > 1:
        result.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it for several processes per machine
    return result


def bound_cpus(environment: dict[str, str]) -> int | None:
    """How many CPUs Slurm bound this task to, where it bound it to its own (`--cpus-per-task` under CPU binding);
    None where the task shares its node's CPUs."""
    asked = environment.get("SLURM_CPUS_PER_TASK", "")
    cpus = len(os.sched_getaffinity(0))
    return cpus if asked.isdigit() and cpus == int(asked) else None


def main(argv: list[str] | None = None) -> None:
    words = list(sys.argv[1:] if argv is None else argv)
    place = slurm_place(dict(os.environ))
    cpus = bound_cpus(dict(os.environ))
    if cpus is not None and "--num_cpu_threads_per_process" not in words:
        # A CPU launch's threads per process (OMP_NUM_THREADS): this task's own CPUs, not Accelerate's guess.
        words = ["--num_cpu_threads_per_process", str(cpus), *words]
    environment, script, arguments, main_address, main_port = launch_environment(words)
    environment = rank_environment(environment, place, main_address, main_port)
    if cpus is not None:
        # The training process's threads on the CPU (cram.train.accelerator.use_cpu_cores): the CPUs bound to it,
        # which no other process of its node shares, unless set.
        environment.setdefault("CRAM_CPU_THREADS", str(cpus))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, script, *arguments], environment)


if __name__ == "__main__":
    run_cli(main)
