"""hbp bench entry point: one benchmark run per config (Hydra).

    python run.py workload=gpt2 mode=checkpoint profile=small
    python run.py -m workload=gpt2,resnet,unet,synthetic_dag mode=naive,checkpoint logger=none
    python run.py experiment=matrix_tiny                   # a README table (conf/experiment/)
    python run.py -m sweep=budget [workload=gpt2]          # a named sweep (conf/sweep/), resumable
    torchrun --nproc_per_node=2 run.py distributed=ddp workload=gpt2 mode=tiny

Config: conf/config.yaml and its groups (workload/, mode/, profile/, logger/, sweep/,
experiment/, distributed/); see README.md.
Bad input gets one line on stderr, "error: <field>=<value> is not accepted: expected ...", and
exit code 2, before anything is written (hbp.bench.RunGuard, hbp.bench.hydra_main).
"""

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

CONF_DIR = Path(__file__).resolve().parent / "conf"
CHECKED_GROUPS = (
    "framework",
    "workload",
    "mode",
    "profile",
    "logger",
    "sweep",
    "experiment",
    "distributed",
)


def check_group_choices(args: list[str]) -> None:
    """Reject `group=option` overrides naming an option that conf/<group>/ does not have, with
    the accepted options (Hydra's own message buries them under its config search path).
    Anything this cannot parse is left to Hydra."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        overrides = OverridesParser.create().parse_overrides(
            [a for a in args if "=" in a and not a.startswith("-")]
        )
    except Exception:
        return
    for override in overrides:
        group = override.key_or_group
        if group not in CHECKED_GROUPS or override.is_delete() or override.package is not None:
            continue
        accepted = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        try:
            sweep = override.is_sweep_override()
            values = list(override.sweep_string_iterator()) if sweep else [override.value()]
        except Exception:  # glob(), range() and the like: Hydra checks those itself
            continue
        for value in values:
            if isinstance(value, str) and value not in accepted:
                sys.stderr.write(
                    f"error: {group}={value!r} is not accepted: expected one of "
                    + ", ".join(accepted)
                    + "\n"
                )
                sys.exit(2)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig):
    from hbp.bench import hydra_main

    return hydra_main(cfg)


def quiet_nonzero_rank(args: list[str]) -> list[str]:
    """Under torchrun only rank 0 writes: other ranks get no run dir files and no log file."""
    if int(os.environ.get("RANK", "0")) == 0:
        return args
    return [*args, "hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=disabled"]


if __name__ == "__main__":
    check_group_choices(sys.argv[1:])
    sys.argv[1:] = quiet_nonzero_rank(sys.argv[1:])
    from hbp.bench.rundir import register_resolvers

    register_resolvers()  # ${run_key:} (the sweep subdir); hbp.bench registers it too
    main()
